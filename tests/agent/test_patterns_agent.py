"""Patterns (gradloc/agent/patterns.py): culprits and outliers per data group, divided by the tokens each group
contributed — from a real store, through the CLI and ``/api/patterns``; every figure checked by hand."""
from __future__ import annotations

import json
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from gradloc.agent import patterns
from gradloc.agent.cli import main
from gradloc.agent.core import AgentCore
from gradloc.agent.http import AgentHttpServer
from gradloc.records import GroupTokens, SampleInfo, SampleOutlier, SampleStats
from gradloc.records.groups import token_class
from gradloc.reports import RankSpan
from gradloc.store.sqlite import IncidentStore
from tests.builders import BELL, ZEBRA, make_incident, step_summary
from tests.postgres import BACKENDS, store_target

T = 1_760_000_000.0
WEB, CODE = SampleInfo(source="web", origin="web.jsonl:7"), SampleInfo(source="code", origin="code.jsonl:3",
                                                                       tags={"lang": "py"})


def _incident(n: int, info: SampleInfo, t: float):
    inc = make_incident(f"{n:032x}", job="j", step=100 + n, time_unix=t)
    return replace(inc, spans=(RankSpan(0, 0.9, replace(BELL, sample_info=info)),))


def _outlier(step: int, info: SampleInfo | None, t: float, tokens: int = 100) -> SampleOutlier:
    return SampleOutlier(kind="surprise", job="j", rank=0, step=step, time_unix=t, score=9.0, z=12.0, baseline=3.0,
                         micro_batch=0, sample=1, sample_id=f"u{step}", start=5, end=20, tokens=tokens, text="1234",
                         sample_info=info)


def _step(step: int, t: float, web: int, code: int, outs=()):
    groups = (GroupTokens(kind="source", name="web", samples=3, tokens=web),
              GroupTokens(kind="source", name="code", samples=1, tokens=code),
              GroupTokens(kind="tag", name="lang=py", samples=1, tokens=code),
              GroupTokens(kind="length", name="≤256", samples=4, tokens=web + code))
    s = replace(step_summary("j", 0, step, t), groups=groups)
    if outs:
        s = replace(s, samples=SampleStats(judged=4, flagged=len(outs), outliers=tuple(outs)))
    return s


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path):
    st = IncidentStore(store_target(request, tmp_path, "p.db"))  # a SQLite file, a PostgreSQL database
    # 10 steps: web 900 tokens a step, code 100 (10% of the tokens); 2 incidents on code, 1 on web; 1 code outlier
    st.put_steps([_step(i, T + i, 900, 100, [_outlier(i, CODE, T + i)] if i == 4 else []) for i in range(10)])
    for n, (info, t) in enumerate([(CODE, T + 2), (CODE, T + 5), (WEB, T + 8)]):
        st.put_incident(_incident(n, info, t))
    yield st
    st.close()


def test_rates_per_million_tokens_rank_the_small_faulty_source_first(store):
    p = patterns.from_store(store, job="j")
    assert (p.incidents, p.culprits, p.outliers) == (3, 3, 1)
    src = {r.name: r for r in p.of("source")}
    assert [r.name for r in p.of("source")] == ["code", "web"]  # highest rate first
    code, web = src["code"], src["web"]
    assert (code.tokens, code.samples, code.culprits, code.incidents, code.outliers) == (1000, 10, 2, 2, 1)
    assert code.per_million == pytest.approx(3 / 1000 * 1e6) and web.per_million == pytest.approx(1 / 9000 * 1e6)
    assert code.flag_share == pytest.approx(0.75) and code.token_share == pytest.approx(0.1)
    tag = p.of("tag")[0]
    assert (tag.name, tag.culprits, tag.outliers, tag.tokens) == ("lang=py", 2, 1, 1000)
    # derived kinds: shares only (no per-step token count)
    pos = {r.name: r for r in p.of("position")}
    assert pos["≤64"].culprits == 3 and pos["≤16"].outliers == 1 and pos["≤64"].per_million is None
    assert {r.name: r.outliers for r in p.of("token_class")}["digits"] == 1
    assert {r.name: r.culprits for r in p.of("token_class")}[token_class(BELL.text)] == 3
    assert {r.name: r.outliers for r in p.of("length")}["≤256"] == 1


def test_a_time_window_and_another_job_narrow_it(store):
    p = patterns.from_store(store, since_unix=T + 3, until_unix=T + 7)
    src = {r.name: r for r in p.of("source")}
    assert (p.incidents, p.outliers) == (1, 1) and src["code"].culprits == 1 and src["code"].tokens == 400
    assert patterns.from_store(store, job="other").rows == ()


def test_the_cli_and_the_api_give_the_same_patterns(store, tmp_path):
    out = CliRunner().invoke(main, ["patterns", "--db", str(store.path), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert patterns.from_dict(data) == patterns.from_store(store)
    text = CliRunner().invoke(main, ["patterns", "--db", str(store.path), "--kind", "source"])
    assert text.exit_code == 0 and "by source:" in text.output and "by tag" not in text.output
    assert text.output.index("code") < text.output.index("web")
    assert "3,000.0 per M tokens" in text.output
    core = AgentCore(store=store).start()
    http = AgentHttpServer(core, "127.0.0.1:0").start()
    try:
        url = "http://%s:%d/api/patterns?job=j" % http.address
        with urllib.request.urlopen(url, timeout=10) as resp:
            api = json.loads(resp.read())
        assert patterns.from_dict(api) == patterns.from_store(store, job="j")
        via = CliRunner().invoke(main, ["patterns", "--agent", "%s:%d" % http.address, "--kind", "source"])
        assert via.exit_code == 0 and via.output.index("code") < via.output.index("web"), via.output
    finally:
        http.stop()
        core.close()


def test_without_a_store_the_api_says_so(tmp_path):
    core = AgentCore(store=None).start()
    http = AgentHttpServer(core, "127.0.0.1:0").start()
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen("http://%s:%d/api/patterns" % http.address, timeout=10)
        assert err.value.code == 400 and b"incident store" in err.value.read()
    finally:
        http.stop()
        core.close()


def test_token_classes():
    assert [token_class(t) for t in ("<|endoftext|>", "  \n", " 2024", "!?", " hello", " Привет", None)] == \
        ["special", "whitespace", "digits", "punctuation", "latin", "other_script", "unknown"]
    assert ZEBRA.text and token_class(ZEBRA.text) == "latin"


def test_the_index_page_shows_the_patterns_of_its_window(store):
    core = AgentCore(store=store).start()
    http = AgentHttpServer(core, "127.0.0.1:0").start()
    try:
        base = "http://%s:%d/incidents" % http.address
        with urllib.request.urlopen(base + "?since=0", timeout=10) as resp:
            page = resp.read().decode()
        with urllib.request.urlopen(base, timeout=10) as resp:  # the default window: the last 7 days (these are older)
            recent = resp.read().decode()
    finally:
        http.stop()
        core.close()
    section = page[page.index("<h2>Patterns</h2>"):]
    assert "by source" in section and section.index(">code<") < section.index(">web<")
    assert "3,000.0" in section and "Patterns" not in recent
