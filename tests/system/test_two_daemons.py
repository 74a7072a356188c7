"""One daemon per node: the shipped dashboards' and exemplars' incident links open the daemon that holds
the incident, with an auth token on both daemons and a real Prometheus 2.42 scraping both (with the token).

Each daemon gets a different incident of the same job through the trainer's codec. The links are built
as Grafana builds them at click time — from the shipped JSON's link templates (the provisioned
datasource's exemplar links as Grafana reads the provisioning file, the tokens dashboard's table links),
the variables' provisioned values,
and the labels Prometheus returns (an exemplar's frame: one field per series and exemplar label; a
table row: its series' labels), interpolated in one pass with ``encodeURI``-style escaping
(``fieldOverrides.ts``: ``replaceVariables(href, scopedVars, VariableFormatID.UriEncode)``) — then
opened with urllib. An exemplar link (signed, no header) must show that daemon's incident; the
table's list link (the list needs the token) must list it.
"""
from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote, urlsplit

import grpc
import yaml

from gradloc.grafana.provision import dashboard_json, provision
from tests.builders import incident_record, step_record
from tests.grafana.promql import provisioned, substitute
from tests.reliability.daemon import serving
from tests.system.prom import PromHandle, _start, _stop, _wait_ready, require_binary
from tests.transport.factories import client_info, encode

TOKEN = "two-nodes-T0KEN"
JOB = "two-node-job"
_VAR = re.compile(r"\$\{([^}]+)\}")
_URI_KEEP = ";,/?:@&=+$-_.!~*'()#"  # what encodeURI leaves as it is (besides letters and digits)


def grafana_href(template: str, variables: dict[str, str], labels: dict[str, str] | None = None,
                 fields: dict[str, str] | None = None, value_raw: str | None = None) -> str:
    """A data link's href as Grafana interpolates it: one pass over ``${...}``; dashboard variables,
    ``__field.labels.X``, ``__data.fields["X"]`` / ``__data.fields.X``, ``__value.raw``; an unknown
    variable stays as written."""
    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        field = re.fullmatch(r'__data\.fields(?:\["([^"]+)"\]|\.(\w+))', name)
        if name == "__value.raw":
            value = value_raw
        elif name.startswith("__field.labels."):
            value = (labels or {}).get(name[len("__field.labels."):])
        elif field:
            value = (fields or {}).get(field[1] or field[2])
        else:
            value = variables.get(name)
        return match.group(0) if value is None else quote(value, safe=_URI_KEEP)

    return _VAR.sub(one, template)


def _get(url: str, token: str | None = None) -> tuple[int, str, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return resp.status, resp.read().decode(), resp.url
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(), url


def _send(ingest: str, rank: int, n: int) -> None:
    """One healthy step and one incident at step ``n`` from a world-size-1 client, with the token."""
    now = time.time()
    steps = [step_record(n - 1, job=JOB, rank=rank, time_unix=now), step_record(n, job=JOB, rank=rank, time_unix=now)]
    msg, _ = encode(steps, [incident_record(n, job=JOB, rank=rank, incident_id=f"{n:x}" * 32, time_unix=now)],
                    client=client_info(job=JOB, rank=rank, world_size=1, client_id=f"node-{n}"))
    with grpc.insecure_channel(ingest) as ch:
        ch.unary_unary("/gradloc.v1.IngestService/Ingest")(
            msg.SerializeToString(), timeout=30, metadata=(("authorization", f"Bearer {TOKEN}"),))


def _prometheus(workdir: Path, targets: list[str]) -> PromHandle:
    """Prometheus scraping ``targets`` with the bearer token (tests/system/prom.py's helpers)."""
    (workdir / "token").write_text(TOKEN)
    cfg = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
           "scrape_configs": [{"job_name": "gradloc-agent", "honor_labels": True,
                               "authorization": {"type": "Bearer", "credentials_file": str(workdir / "token")},
                               "static_configs": [{"targets": targets}]}]}
    (workdir / "prometheus.yml").write_text(json.dumps(cfg))
    handle = _start(require_binary(), workdir, workdir / "prometheus.yml", ())
    try:
        _wait_ready(handle)
    except BaseException:
        _stop(handle.process)
        raise
    return handle


def _poll(what: str, fn, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < deadline, f"{what}: nothing within {timeout}s"
        time.sleep(0.5)


def test_each_link_opens_the_daemon_that_holds_the_incident(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "prom").mkdir()
    env = {"GRADLOC_AGENT_AUTH_TOKEN": TOKEN}
    flags = ("--ingest", "127.0.0.1:0", "--http", "127.0.0.1:0", "--straggler-deadline-s", "1")
    with serving(tmp_path / "a", *flags, env=env) as a, serving(tmp_path / "b", *flags, env=env) as b:
        daemons = {d["http"]: d for d in (a, b)}
        _send(a["ingest"], 0, 3)
        _send(b["ingest"], 0, 7)
        held = {}  # daemon http address -> the incident id it holds
        for http in daemons:
            rows = _poll(f"{http}'s incident", lambda: json.loads(_get(f"http://{http}/api/incidents", TOKEN)[1]))
            assert len(rows) == 1, rows
            held[http] = rows[0]["incident_id"]
        assert len(set(held.values())) == 2

        prom = _prometheus(tmp_path / "prom", list(daemons))
        try:
            start = time.time() - 600
            _check_exemplar_links(tmp_path, prom, held, start)
            _check_table_links(prom, held, agent_url=f"http://{a['http']}")
        except BaseException as exc:
            exc.add_note(f"--- prometheus log ---\n{prom.log()[-6000:]}")
            raise
        finally:
            _stop(prom.process)
        for d in (a, b):
            assert TOKEN not in Path(d["log"]).read_text()  # debug log, every request: no token


def _check_exemplar_links(tmp_path: Path, prom: PromHandle, held: dict[str, str], start: float) -> None:
    """The provisioned datasource's exemplar links, built from the exemplars Prometheus returns for the
    'Incidents per hour by status' panel's query."""
    out = tmp_path / "grafana"
    provision(out, agent_url=f"http://{next(iter(held))}", signed=True)  # the first daemon (a single-URL setup)
    source = yaml.safe_load((out / "provisioning/datasources/gradloc.yaml").read_text())["datasources"][0]
    per_node, single = ({**d, "url": provisioned(d["url"])} for d in source["jsonData"]["exemplarTraceIdDestinations"])
    tokens = dashboard_json("tokens")
    panel = next(p for p in tokens["panels"] if p["title"] == "Incidents per hour by status")
    expr = substitute(panel["targets"][0]["expr"])

    def exemplars() -> list[tuple[dict[str, str], str]]:
        rows = []
        for series in prom.exemplars(expr, start, time.time() + 60):
            for ex in series["exemplars"]:
                fields = {**series["seriesLabels"], **ex["labels"]}  # the exemplar frame's fields
                rows.append((fields, ex["labels"].get("trace_id", "")))
        instances = {f["instance"] for f, _ in rows if f.get("sig")}
        return rows if instances == set(held) else None

    rows = _poll("signed exemplars from both daemons", exemplars)
    seen = set()
    for fields, trace_id in rows:
        href = grafana_href(per_node["url"], {}, fields=fields, value_raw=trace_id)
        assert urlsplit(href).netloc == fields["instance"], href
        code, page, final = _get(href)  # a browser: no Authorization header
        mine, other = held[fields["instance"]], next(v for k, v in held.items() if k != fields["instance"])
        assert code == 200 and urlsplit(final).netloc == fields["instance"], (code, href, page[:300])
        assert mine[:12] in page and other[:12] not in page, href
        seen.add(fields["instance"])
        code, page, _ = _get(grafana_href(single["url"], {}, fields=fields, value_raw=trace_id))
        if urlsplit(single["url"]).netloc == fields["instance"]:
            assert code == 200 and mine[:12] in page  # the single agent_url works for its own daemon's incidents
        else:
            assert code in (403, 404) and mine[:12] not in page  # and not for another node's: why per-node links
    assert seen == set(held)


def _check_table_links(prom: PromHandle, held: dict[str, str], agent_url: str) -> None:
    """The 'Recent incidents' table: each row's per-node link lists that daemon's incident of the job."""
    dash = dashboard_json("tokens", agent_url)
    variables = {v["name"]: v["current"]["value"] for v in dash["templating"]["list"]
                 if v["name"] in ("agent_url", "agent_scheme")}
    panel = next(p for p in dash["panels"] if p["title"].startswith("Recent incidents"))
    per_node = panel["fieldConfig"]["defaults"]["links"][0]["url"]
    result = prom.query(substitute(panel["targets"][0]["expr"]))
    assert {r["metric"].get("instance") for r in result} == set(held), result
    for row in result:
        href = grafana_href(per_node, variables, labels=row["metric"])
        instance = row["metric"]["instance"]
        assert urlsplit(href).netloc == instance and f"job={JOB}" in href, href
        code, page, _ = _get(href)
        assert code == 401 and held[instance][:12] not in page  # the list is not a signed page
        code, page, _ = _get(href, TOKEN)  # through a proxy that adds the token
        other = next(v for k, v in held.items() if k != instance)
        assert code == 200 and held[instance][:12] in page and other[:12] not in page, href
