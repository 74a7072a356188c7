"""The bundled dashboards and rules, checked without Grafana (none is installable here): structure,
metric names against ``metric_specs``, every query parsed by the real ``promtool``, the rules
checked and unit-tested by ``promtool``, and the provisioning output. Queries are executed against
a real Prometheus in tests/system/test_dashboards_prometheus.py."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from gradloc.agent.cli import main
from gradloc.exporters.metric_specs import SPECS
from gradloc.grafana.dashboards import DASHBOARDS
from gradloc.grafana.provision import rules_text
from tests.grafana.promql import as_rule_file, metric_names, provisioned, queries

HERE = Path(__file__).resolve().parent
SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: run scripts/setup.sh (Debian's prometheus package)", pytrace=False)
    return path


def test_structure_of_every_dashboard() -> None:
    uids = [b()["uid"] for b in DASHBOARDS.values()]
    assert len(set(uids)) == len(uids) == 6
    for build in DASHBOARDS.values():
        dash = build()
        names = [v["name"] for v in dash["templating"]["list"]]
        assert {"datasource", "job", "rank", "layer"} <= set(names), names
        ids = [p["id"] for p in dash["panels"]]
        assert len(set(ids)) == len(ids)
        cells: set[tuple[int, int]] = set()
        for p in dash["panels"]:
            g = p["gridPos"]
            assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, (dash["uid"], p["title"])
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not cells & mine, f"{dash['uid']}: {p['title']!r} overlaps another panel"
            cells |= mine
            assert p["fieldConfig"]["defaults"]["unit"], f"{p['title']!r} has no unit"
            refs = [t["refId"] for t in p["targets"]]
            assert refs and len(set(refs)) == len(refs)
            assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
            assert p["datasource"]["uid"] == "${datasource}"


def test_every_metric_a_panel_uses_is_in_metric_specs() -> None:
    known = {s.prom for s in SPECS}
    for uid, title, expr in queries():
        for name in metric_names(expr):
            base = next((name[: -len(s)] for s in SUFFIXES if name.endswith(s) and name[: -len(s)] in known), name)
            assert base in known, f"{uid} / {title}: {name} is not a gradloc metric"


def test_every_query_parses_with_promtool(tmp_path: Path) -> None:
    exprs = [e for _, _, e in queries()]
    path = tmp_path / "queries.yml"
    path.write_text(json.dumps(as_rule_file(exprs)))  # JSON is YAML
    res = subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in res.stdout


def test_rules_check_and_unit_tests_pass(tmp_path: Path) -> None:
    rules = tmp_path / "gradloc-rules.yml"
    rules.write_text(rules_text())
    res = subprocess.run([_promtool(), "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    test = tmp_path / "rules_test.yml"
    test.write_text((HERE / "rules_test.yml").read_text())
    res = subprocess.run([_promtool(), "test", "rules", str(test)], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout


def test_a_wrong_expectation_fails_promtool(tmp_path: Path) -> None:
    """The rule tests can fail: the same file with one expected alert removed is refused."""
    (tmp_path / "gradloc-rules.yml").write_text(rules_text())
    text = (HERE / "rules_test.yml").read_text().replace("alertname: GradlocNonfiniteGradients",
                                                         "alertname: GradlocNonfiniteGradientsX")
    (tmp_path / "rules_test.yml").write_text(text)
    res = subprocess.run([_promtool(), "test", "rules", "rules_test.yml"], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert res.returncode == 1 and "FAILED" in res.stdout + res.stderr


NO_AGENT_CONFIG = {"GRADLOC_AGENT_CONFIG": None, "GRADLOC_AGENT_AUTH_TOKEN": None, "GRADLOC_AGENT_AUTH_TOKEN_FILE": None}


def _exemplar_urls(out: Path) -> list[str]:
    source = yaml.safe_load((out / "provisioning/datasources/gradloc.yaml").read_text())["datasources"][0]
    return [provisioned(d["url"]) for d in source["jsonData"]["exemplarTraceIdDestinations"]]


def test_exemplar_links_carry_sig_only_for_daemons_with_a_token(tmp_path: Path) -> None:
    """Without a token a daemon mints no ``sig``: the links end at the trace id (no dangling ``?sig=``); with
    one (the agent config's token, or --signed-links) they carry the exemplar's ``sig``."""
    page = "/incidents/trace/${__value.raw}"
    sig = '?sig=${__data.fields["sig"]}'
    cases = [([], NO_AGENT_CONFIG, ""), (["--signed-links"], NO_AGENT_CONFIG, sig),
             ([], {**NO_AGENT_CONFIG, "GRADLOC_AGENT_AUTH_TOKEN": "t" * 32}, sig),
             (["--no-signed-links"], {**NO_AGENT_CONFIG, "GRADLOC_AGENT_AUTH_TOKEN": "t" * 32}, "")]
    for i, (flags, env, tail) in enumerate(cases):
        out = tmp_path / str(i)
        res = CliRunner().invoke(main, ["grafana", "provision", str(out), "--agent-url", "http://agent:9917", *flags],
                                 env=env)
        assert res.exit_code == 0, res.output
        assert _exemplar_urls(out) == ['http://${__data.fields["instance"]}' + page + tail,
                                       "http://agent:9917" + page + tail], (flags, env)
        assert ("do not carry ?sig=" in res.stderr) == (tail == "")


def test_provision_and_export_cli(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["grafana", "provision", str(tmp_path), "--prometheus-url", "http://prom:9090",
                                    "--agent-url", "http://agent:9917", "--signed-links"], env=NO_AGENT_CONFIG)
    assert res.exit_code == 0, res.output
    dashes = sorted((tmp_path / "dashboards").glob("*.json"))
    assert len(dashes) == 6
    for path in dashes:
        dash = json.loads(path.read_text())
        agent = next(v for v in dash["templating"]["list"] if v["name"] == "agent_url")
        assert agent["query"] == "http://agent:9917"
    ds = (tmp_path / "provisioning/datasources/gradloc.yaml").read_text()
    assert ds.startswith("apiVersion: 1\n") and '"http://prom:9090"' in ds and "type: prometheus" in ds
    assert "${" not in ds.replace("$${", "")  # Grafana would expand ${...} from its environment
    source = yaml.safe_load(ds)["datasources"][0]  # exemplars (trace ids) link to the incident's page
    page = '/incidents/trace/${__value.raw}?sig=${__data.fields["sig"]}'  # sig: the daemon's signed link
    assert [(d["name"], provisioned(d["url"])) for d in source["jsonData"]["exemplarTraceIdDestinations"]] == [
        ("trace_id", 'http://${__data.fields["instance"]}' + page),  # the daemon Prometheus scraped it from
        ("trace_id", "http://agent:9917" + page)]
    assert (tmp_path / "provisioning/dashboards/gradloc.yaml").read_text().startswith("apiVersion: 1\n")
    assert (tmp_path / "prometheus/gradloc-rules.yml").read_text() == rules_text()
    out = CliRunner().invoke(main, ["grafana", "export", "layers"])
    assert out.exit_code == 0 and json.loads(out.output)["uid"] == "gradloc-layers"
    bad = CliRunner().invoke(main, ["grafana", "export", "nope"])
    assert bad.exit_code == 2


def test_every_alert_has_a_case_that_fires_and_one_that_does_not() -> None:
    alerts = {r["alert"] for g in yaml.safe_load(rules_text())["groups"] for r in g["rules"] if "alert" in r}
    cases = [c for t in yaml.safe_load((HERE / "rules_test.yml").read_text())["tests"] for c in t["alert_rule_test"]]
    fires = {c["alertname"] for c in cases if c["exp_alerts"]}
    quiet = {c["alertname"] for c in cases if not c["exp_alerts"]}
    assert len(alerts) == 12 and alerts <= fires and alerts <= quiet, (alerts - fires, alerts - quiet)


def test_https_agents_get_https_links(tmp_path: Path) -> None:
    """--agent-url https://… (daemons with --tls-cert): per-node links and the scheme variable use https."""
    res = CliRunner().invoke(main, ["grafana", "provision", str(tmp_path), "--agent-url", "https://gw.example:443/"])
    assert res.exit_code == 0, res.output
    source = yaml.safe_load((tmp_path / "provisioning/datasources/gradloc.yaml").read_text())["datasources"][0]
    urls = [provisioned(d["url"]) for d in source["jsonData"]["exemplarTraceIdDestinations"]]
    assert urls[0].startswith('https://${__data.fields["instance"]}/') and urls[1].startswith("https://gw.example:443/incidents/")
    dash = json.loads((tmp_path / "dashboards/gradloc-tokens.json").read_text())
    scheme = next(v for v in dash["templating"]["list"] if v["name"] == "agent_scheme")
    assert scheme["current"]["value"] == "https" and [o["value"] for o in scheme["options"] if o["selected"]] == ["https"]


def test_every_incident_link_has_a_per_node_and_an_agent_url_form() -> None:
    """Each panel link to the incident list exists twice: on the series' own daemon
    (``${agent_scheme}://${__field.labels.instance}``) and at ``${agent_url}``; the links' labels are
    kept by every query of the panel (run against two real daemons in tests/system/test_two_daemons.py)."""
    linked = [(d()["uid"], p) for d in DASHBOARDS.values() for p in d()["panels"] if p["fieldConfig"]["defaults"]["links"]]
    assert len(linked) >= 2
    for uid, panel in linked:
        urls = [link["url"] for link in panel["fieldConfig"]["defaults"]["links"]]
        assert any(u.startswith("${agent_scheme}://${__field.labels.instance}/incidents") for u in urls), (uid, urls)
        assert any(u.startswith("${agent_url}/incidents") for u in urls), (uid, urls)
        for target in panel["targets"]:
            by = re.search(r"(?:sum|max|min|avg|count) by \(([^)]*)\)", target["expr"])
            if by:  # an aggregation keeps what the links read
                kept = {x.strip() for x in by.group(1).split(",")}
                assert {"instance", "job"} <= kept, (uid, panel["title"], target["expr"])
