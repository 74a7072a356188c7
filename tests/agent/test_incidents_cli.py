"""``gradloc-agent incidents list|show|export`` against a real store, and the pure renderers behind it."""
from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from gradloc.agent.cli import main
from gradloc.agent.incidents_cli import parse_since
from gradloc.agent.render_correlated import correlated_text, local_time, ranks_text
from gradloc.store import IncidentStore, correlated_from_dict
from tests.builders import INCIDENT_ID, T0, incident_series, make_incident, nonfinite_incident

REPO = Path(__file__).resolve().parents[2]
HL_BELL = "\x1b[1;97;41m bell\x1b[0m"  # gradloc.agent.render.highlight's colours around the culprit


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """Five incidents: the 3-rank partial one, a NaN-gradient one, and three of job "other"."""
    path = tmp_path / "incidents.db"
    with IncidentStore(path) as store:
        for inc in [make_incident(), nonfinite_incident(), *incident_series(3, job="other", start=T0 + 7200)]:
            store.put_incident(inc)
    return path


def run(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(main, ["incidents", *args], env=env)


# -- list ------------------------------------------------------------------------------------

def test_list_prints_an_aligned_table_newest_first(db: Path) -> None:
    result = run("list", "--db", str(db))
    assert result.exit_code == 0, result.output
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["ID", "TIME", "JOB", "STEP", "STATUS", "KINDS", "‖∇‖", "EXPLAINED", "MISSING"]
    assert [r.split()[0] for r in rows] == ["00029a0e5b2d", "00019a0e5b2d", "00009a0e5b2d", "deadbeefdead",
                                            "7f3c9a0e5b2d"]
    assert rows[4].split() == ["7f3c9a0e5b2d", local_time(T0), "llm-7b", "1200", "partial",
                               "grad_spike,loss_spike", "4.95", "93.0%", "2"]
    assert rows[3].split()[5:] == ["nonfinite_grad", "n/a", "n/a", "-"]
    for col in ("STATUS", "KINDS", "MISSING"):  # left-aligned columns start where their header starts
        assert {r[header.index(col) - 1] for r in rows} == {" "} and all(r[header.index(col)] != " " for r in rows)
    assert {len(r[:header.index("STEP") + 4].rstrip()) for r in rows} == {header.index("STEP") + 4}  # right-aligned


def test_list_filters_and_json(db: Path) -> None:
    result = run("list", "--db", str(db), "--json", "--job", "llm-7b")
    rows = json.loads(result.stdout)
    assert [r["incident_id"] for r in rows] == ["deadbeef" * 4, INCIDENT_ID]
    assert rows[0]["global_norm"] == "nan" and rows[0]["explained_share"] is None
    assert rows[1] == {"incident_id": INCIDENT_ID, "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", "job": "llm-7b",
                       "step": 1200, "time_unix": T0, "status": "partial", "kinds": ["grad_spike", "loss_spike"],
                       "global_norm": 4.95, "ranks_missing": [2], "explained_share": 0.93, "probes": 2}
    limited = json.loads(run("list", "--db", str(db), "--json", "--limit", "2").stdout)
    assert [r["step"] for r in limited] == [120, 110]
    since = json.loads(run("list", "--db", str(db), "--json", "--since", str(int(T0 + 60))).stdout)
    assert [r["job"] for r in since] == ["other"] * 3 + ["llm-7b"]
    assert "no incidents for job 'x'" in run("list", "--db", str(db), "--job", "x").stdout


def test_list_since_a_duration_is_relative_to_now(tmp_path: Path) -> None:
    path, now = tmp_path / "recent.db", time.time()
    with IncidentStore(path) as store:
        store.put_incident(make_incident("aa" * 16, time_unix=now - 3600))
        store.put_incident(make_incident("bb" * 16, time_unix=now - 3 * 86400))
    ids = [r["incident_id"] for r in json.loads(run("list", "--db", str(path), "--json", "--since", "1d").stdout)]
    assert ids == ["aa" * 16]
    assert len(json.loads(run("list", "--db", str(path), "--json", "--since", "1w").stdout)) == 2


def test_gradloc_db_env_is_the_default(db: Path) -> None:
    result = run("list", "--json", env={"GRADLOC_DB": str(db)})
    assert result.exit_code == 0 and len(json.loads(result.stdout)) == 5


def test_parse_since() -> None:
    assert parse_since("2h", 10_000.0) == 10_000.0 - 7200
    assert parse_since(" 1.5D ", 200_000.0) == 200_000.0 - 129_600
    assert parse_since("30m", 5000.0) == 3200.0 and parse_since("1w", 1e6) == 1e6 - 604800
    assert parse_since("1760000000", 0.0) == 1_760_000_000.0
    for bad in ("3x", "-5", "nan", "inf", "", "h"):
        with pytest.raises(ValueError, match="duration like 30m"):
            parse_since(bad, 0.0)


# -- show ------------------------------------------------------------------------------------

def test_show_renders_ranks_shares_spans_and_findings(db: Path) -> None:
    result = run("show", "7f3c", "--db", str(db))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.startswith("incident 7f3c9a0e5b2d · job llm-7b · step 1200 · partial\n")
    assert "ranks: 3 expected (0–2) · 2 reported (0–1) · 1 missing (2)" in out
    assert "note: rank 2 missed the straggler deadline" in out
    rank_rows = {line.split()[0]: line.split() for line in out.splitlines() if re.match(r"^\s+[0-2]\s", line)}
    assert rank_rows["0"] == ["0", "72.0%", "3.5", "2.9", "yes", "located", "2"]
    assert rank_rows["2"][1:] == ["-", "-", "-", "-", "did", "not", "report", "-"]
    assert "  rank 0: mb 0 6.0% · mb 3 66.0%\n  rank 1: mb 0 20.0% · mb 1 8.0%" in out
    bell = out.index("• rank 0 · micro-batch 3 · sample 1 (sample id s1200-3-1) · position 41 · share 64.8%")
    zebra = out.index("• rank 1 · micro-batch 0 · sample 2 · positions 7–8 · share 14.0%")
    assert bell < zebra
    assert "…the quick brown[[zebra\\tqu]]ick fox…" in out
    assert out.count("before the[[ bell]] rings.") == 2  # the merged span and rank 0's own finding
    assert out.index("incident 003c9a0e5b2d · job llm-7b · rank 0 · step 1200") < out.index(
        "incident 013c9a0e5b2d · job llm-7b · rank 1 · step 1200")
    assert "\x1b" not in out  # CliRunner's stdout is no terminal: no colour unless asked


def test_show_colour_is_forced_or_refused_by_flag(db: Path) -> None:
    coloured = run("show", INCIDENT_ID, "--db", str(db), "--color").stdout
    assert HL_BELL in coloured and "[[ bell]]" not in coloured
    plain = run("show", INCIDENT_ID, "--db", str(db), "--no-color").stdout
    assert "\x1b" not in plain and "[[ bell]]" in plain


def test_show_json_is_the_full_correlated_incident(db: Path) -> None:
    out = run("show", "deadbeef", "--db", str(db), "--json").stdout
    assert repr(correlated_from_dict(json.loads(out))) == repr(nonfinite_incident())
    assert correlated_from_dict(json.loads(run("show", "7f3", "--db", str(db), "--json").stdout)) == make_incident()


@pytest.mark.parametrize("ident,message", [("ffff", "no incident 'ffff' in"), ("000", "is ambiguous"),
                                           ("  ", "required")])
def test_show_unknown_or_ambiguous_ids_exit_1(db: Path, ident: str, message: str) -> None:
    result = run("show", ident, "--db", str(db))
    assert result.exit_code == 1 and message in result.stderr
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)


# -- export ------------------------------------------------------------------------------------

def test_export_writes_json_lines_oldest_first(db: Path) -> None:
    result = run("export", "--db", str(db))
    lines = result.stdout.splitlines()
    incs = [correlated_from_dict(json.loads(line)) for line in lines]
    assert [i.incident_id[:4] for i in incs] == ["7f3c", "dead", "0000", "0001", "0002"]
    assert incs[0] == make_incident() and repr(incs[1]) == repr(nonfinite_incident())
    assert len(run("export", "--db", str(db), "--job", "other", "--json").stdout.splitlines()) == 3
    assert len(run("export", "--db", str(db), "--since", str(T0 + 7200)).stdout.splitlines()) == 3


def test_export_to_a_file(db: Path, tmp_path: Path) -> None:
    target = tmp_path / "out.jsonl"
    result = run("export", "--db", str(db), "--job", "llm-7b", "--output", str(target))
    assert result.exit_code == 0 and result.stdout == ""
    assert f"exported 2 incident(s) to {target}" in result.stderr
    first = json.loads(target.read_text(encoding="utf-8").splitlines()[0])
    assert first["incident_id"] == INCIDENT_ID and first["spans"][0]["span"]["text"] == " bell"
    bad = run("export", "--db", str(db), "--output", str(tmp_path / "no" / "such" / "dir.jsonl"))
    assert bad.exit_code == 1 and "cannot write" in bad.stderr


# -- failures --------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", [["list"], ["show", "abc"], ["export"]])
def test_a_missing_database_exits_1_without_creating_it(tmp_path: Path, cmd: list[str]) -> None:
    missing = tmp_path / "nowhere.db"
    result = run(*cmd, "--db", str(missing))
    assert result.exit_code == 1 and "no incident store at" in result.stderr and "GRADLOC_DB" in result.stderr
    assert not missing.exists() and isinstance(result.exception, SystemExit)


def test_a_database_from_a_newer_gradloc_exits_1(db: Path) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA user_version = 99")
    result = run("list", "--db", str(db))
    assert result.exit_code == 1 and "newer gradloc" in result.stderr


# -- real processes ------------------------------------------------------------------------------

def test_the_installed_script_lists_json_in_a_real_process(db: Path) -> None:
    script = Path(sys.executable).parent / "gradloc-agent"
    out = subprocess.run([str(script), "incidents", "list", "--db", str(db), "--json"], capture_output=True,
                         text=True, timeout=60, check=True, env={**os.environ, "TZ": "UTC"})
    rows = json.loads(out.stdout)
    assert [r["step"] for r in rows] == [120, 110, 100, 1300, 1200]
    table = subprocess.run([str(script), "incidents", "list", "--db", str(db)], capture_output=True, text=True,
                           timeout=60, check=True, env={**os.environ, "TZ": "UTC"}).stdout
    assert "7f3c9a0e5b2d  2025-10-09T08:53:20  llm-7b" in table


def test_the_incidents_commands_never_import_torch(db: Path) -> None:
    code = (
        "import sys\n"
        "from gradloc.agent.cli import main\n"
        f"for args in (['list'], ['show', '7f3c'], ['export'], ['show', '--json', 'dead']):\n"
        f"    main(['incidents', *args, '--db', {str(db)!r}], standalone_mode=False)\n"
        "print('TORCH', 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO, check=True)
    assert "incident 7f3c9a0e5b2d" in out.stdout  # the commands really ran
    assert out.stdout.rstrip().endswith("TORCH False")


# -- pure renderers --------------------------------------------------------------------------------

def test_ranks_text_collapses_runs() -> None:
    assert ranks_text([8, 0, 1, 2, 3, 5, 7]) == "0–3, 5, 7–8"
    assert ranks_text([4]) == "4" and ranks_text(()) == "none"


def test_correlated_text_without_spans_or_micro_batches() -> None:
    import dataclasses

    inc = dataclasses.replace(make_incident(spans=False), micro_batch_shares=())
    text = correlated_text(inc, color=False)
    assert "culprit spans, largest share first\n  no culprit tokens found" in text
    assert "per-micro-batch shares\n  none reported" in text
    assert correlated_text(inc, color=True).startswith("\x1b[1mincident 7f3c9a0e5b2d")


def test_reading_does_not_wait_for_the_writer_lock(db: Path) -> None:
    """The daemon may be mid-transaction: the CLI only reads, so it must not queue behind the writer."""
    writer = sqlite3.connect(db, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("DELETE FROM incidents")  # uncommitted: readers still see all five
    try:
        start = time.perf_counter()
        result = run("list", "--db", str(db), "--json")
        assert result.exit_code == 0, result.output
        assert time.perf_counter() - start < 2.0 and len(json.loads(result.stdout)) == 5
    finally:
        writer.execute("ROLLBACK")
        writer.close()


def test_show_names_the_flagged_layers_that_matter_and_counts_the_rest(tmp_path: Path) -> None:
    """16 of 16 layers flagged (the demo): the five with the largest share of ‖∇‖², then "+11 more"."""
    import dataclasses

    from gradloc.records import LayerStats

    inc = make_incident()
    f0 = inc.findings[0]
    names = [f"blocks.{i}" for i in range(16)]
    norms = {name: 0.1 * (i + 1) for i, name in enumerate(names)}  # blocks.15 the largest
    layers = tuple(LayerStats(layer=n, grad_norm=g, grad_max_abs=g, nonfinite=0, param_norm=1.0, numel=4, z=20.0 - g)
                   for n, g in norms.items())
    z_order = tuple(sorted(names, key=lambda n: -(20.0 - norms[n])))  # the detector lists the largest z first
    f0 = dataclasses.replace(f0, top_layers=layers, spike=dataclasses.replace(f0.spike, layers=z_order))
    inc = dataclasses.replace(inc, findings=(f0,), top_layers=z_order)
    with IncidentStore(tmp_path / "f.db") as store:
        store.put_incident(inc)
    out = run("show", inc.incident_id[:8], "--db", str(tmp_path / "f.db")).stdout
    line = next(x for x in out.splitlines() if x.startswith("  layers: "))
    top5 = sorted(names, key=lambda n: -norms[n])[:5]
    shares = [f"{n} {100 * (norms[n] / f0.spike.global_norm) ** 2:.1f}% (z {20.0 - norms[n]:.4g}) ▲" for n in top5]
    assert line == (f"  layers: {', '.join(shares)} +11 more (% of ‖∇‖², largest first; 16 of 16 layer(s) flagged ▲: "
                    "z above the layer z threshold)")


def test_flagged_layers_without_shares_keep_the_detectors_order() -> None:
    """A finding from a client before the z field lists five layers: the others have no share, only names."""
    import dataclasses

    from gradloc.agent.render_correlated import flagged_layers_text

    inc = dataclasses.replace(make_incident(), top_layers=("x", "blocks.1.proj", "y", "z", "w", "v"))
    assert flagged_layers_text(inc, k=3) == ("blocks.1.proj 0.0% ▲, head 0.0%, x ▲ +4 more (% of ‖∇‖², largest first; "
                                             "6 layer(s) flagged ▲: z above the layer z threshold)")
    assert flagged_layers_text(dataclasses.replace(inc, findings=()), k=2) == \
        "x, blocks.1.proj +4 more (6 layer(s) flagged ▲: z above the layer z threshold)"


def test_show_html_draws_the_follow_up_steps_the_store_holds(tmp_path: Path) -> None:
    """The page written by ``show --html`` (as the daemon's /incidents/<id>) charts the store's steps after the
    incident: what the incident itself cannot hold."""
    from tests.builders import step_summary

    inc = make_incident()  # step 1200 of job llm-7b, findings on ranks 0..
    path = tmp_path / "s.db"
    with IncidentStore(path) as store:
        store.put_incident(inc)
        store.put_steps([step_summary(inc.job, 0, s, 0.0) for s in range(inc.step + 1, inc.step + 6)])
    out = tmp_path / "page.html"
    res = run("show", inc.incident_id[:8], "--db", str(path), "--html", str(out))
    assert res.exit_code == 0, res.output
    page = out.read_text()
    assert "Follow-up steps: 5 after the incident" in page
    assert all(f"<td>{s}</td>" in page for s in range(inc.step + 1, inc.step + 6))


def _follow_up(opener_step: int, **kw) -> object:
    """A new-cause incident at step 1207 following the incident of ``opener_step`` (every rank's finding says so)."""
    from dataclasses import replace

    inc = make_incident("cd" * 16, step=1207, time_unix=T0 + 70, **kw)
    detail = f"new cause inside the episode of step {opener_step}: 2 new culprit sample(s) on a step whose rollouts disagree"
    findings = tuple(replace(f, spike=replace(f.spike, follows=opener_step, detail=detail)) for f in inc.findings)
    return replace(inc, findings=findings)


def test_show_says_which_incident_a_follow_up_follows(tmp_path: Path) -> None:
    path = tmp_path / "f.db"
    with IncidentStore(str(path)) as store:
        store.put_incident(make_incident())  # step 1200: the episode's incident
        store.put_incident(_follow_up(1200))
        store.put_incident(make_incident("ef" * 16, step=1300, time_unix=T0 + 200))
    out = run("show", "cdcd", "--db", str(path), "--no-color", "--html", str(tmp_path / "p.html"))
    assert out.exit_code == 0, out.output
    assert f"follows: the incident of step 1200 (id {INCIDENT_ID})" in out.output
    assert "detector: new cause inside the episode of step 1200" in out.output
    page = (tmp_path / "p.html").read_text(encoding="utf-8")
    assert f'href="/incidents/{INCIDENT_ID}"' in page and "the incident of step 1200" in page
    plain = run("show", "efef", "--db", str(path), "--no-color")  # not a follow-up: no such line
    assert plain.exit_code == 0 and "follows:" not in plain.output


def test_show_a_follow_up_whose_opener_is_not_stored(tmp_path: Path) -> None:
    path = tmp_path / "f.db"
    with IncidentStore(str(path)) as store:
        store.put_incident(_follow_up(1100))
    out = run("show", "cdcd", "--db", str(path), "--no-color", "--html", str(tmp_path / "p.html"))
    assert out.exit_code == 0, out.output
    assert "follows: the incident of step 1100, whose episode" in out.output  # no id to give
    page = (tmp_path / "p.html").read_text(encoding="utf-8")
    assert "the incident of step 1100 (not in this store)" in page and 'href="/incidents/' not in page.split("<h1>")[1][:400]
