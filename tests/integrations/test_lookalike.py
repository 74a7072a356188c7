"""Look-alikes of quarantined rows (gradloc/integrations/lookalike.py): a brute-force reference for the chunked
computation, real text beside a real mis-decoding fault, and the list's way back into the store."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from gradloc.agent.cli import main
from gradloc.integrations import lookalike
from gradloc.integrations.lookalike import LookalikeConfig
from gradloc.integrations.quarantine import QuarantineList
from gradloc.records import QuarantineEntry
from gradloc.store import IncidentStore

LICENSES = Path("/usr/share/common-licenses")


def _text_rows(n: int, size: int = 128) -> list[list[int]]:
    """n windows of real English text (Debian's licence texts), as bytes."""
    raw = b"".join(p.read_bytes() for p in sorted(LICENSES.iterdir()) if p.is_file())
    return [list(raw[i * size:(i + 1) * size]) for i in range(n)]


def _utf16(row: list[int]) -> list[int]:
    """The row's text as UTF-16-LE read one byte per character: every other byte a NUL (same length)."""
    return list(bytes(row[: len(row) // 2]).decode("latin-1").encode("utf-16-le"))


def _reference(rows, keys, held, cfg):
    """The rule of the module docstring, row by row, without chunks or shared arrays."""
    def mix(r):
        v = np.zeros(cfg.buckets)
        for t in r:
            if t >= 0:
                v[t % cfg.buckets] += 1
        return v / (np.linalg.norm(v) or 1.0)

    mixes = [mix(r) for r in rows]
    z = {}
    for s in {k[2] for k in keys}:
        members = [i for i, k in enumerate(keys) if k[2] == s]
        c = sum(mixes[i] for i in members)
        c = c / np.linalg.norm(c)
        cos = {i: float(mixes[i] @ c) for i in members}
        med = float(np.median(list(cos.values())))
        mad = 1.4826 * float(np.median([abs(v - med) for v in cos.values()]))
        z.update({i: (med - cos[i]) / max(mad, 1e-3) for i in members})
    seeds = [i for i in range(len(rows)) if held[i] and z[i] >= cfg.min_atypical_z]
    out = []
    for i in range(len(rows)):
        if held[i] or z[i] < cfg.min_atypical_z or not seeds:
            continue
        sims = [float(mixes[i] @ mixes[j]) for j in seeds]
        if max(sims) >= cfg.min_similarity:
            out.append((i, seeds[int(np.argmax(sims))], round(max(sims), 5)))
    return out


def test_the_chunked_rule_matches_a_brute_force_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lookalike, "_CHUNK", 7)  # many chunks, a partial last one
    gen = random.Random(3)
    rows, keys = [], []
    for i in range(60):
        kind = gen.choice(["a", "b"])
        base = list(range(10, 30)) if kind == "a" else list(range(40, 70))
        row = [gen.choice(base) for _ in range(gen.randint(5, 40))]
        if i % 9 == 0:  # a few rows of one odd content in both sources, some of them held
            row = [gen.choice([0, 1, 2, 200]) for _ in range(30)]
        rows.append(row)
        keys.append((f"s{i}", f"f:{i}", kind))
    held = [i % 18 == 0 for i in range(60)]
    cfg = LookalikeConfig(buckets=97, min_similarity=0.8, min_atypical_z=3.0)
    got = lookalike.find(rows, keys, lambda k: held[int(k[0][1:])], cfg)
    want = _reference(rows, keys, held, cfg)
    assert want, "the reference case must find look-alikes to compare"
    assert [(g.index, g.like, round(g.similarity, 5)) for g in got] == want
    assert all(g.key == keys[g.index] for g in got)


def test_mis_decoded_rows_follow_the_two_flagged_ones_and_no_clean_row_does() -> None:
    rows = _text_rows(300)
    bad = list(range(7, 300, 25))  # 12 rows mis-decoded (4%)
    for i in bad:
        rows[i] = _utf16(rows[i])
    keys = [(None, f"/data/licences.txt:{i}", "legal") for i in range(300)]
    typical = 100  # a quarantined row with ordinary content (e.g. wrong labels): it seeds nothing
    q = QuarantineList((QuarantineEntry(kind="origin", value=keys[bad[0]][1], reason="outlier z 9.1", job="j",
                                        step=12),
                        QuarantineEntry(kind="origin", value=keys[bad[5]][1], reason="culprit", job="j", step=40),
                        QuarantineEntry(kind="origin", value=keys[typical][1], reason="outlier z 6.2")))
    out = q.with_lookalikes(rows, keys)
    added = out.entries[len(q.entries):]
    assert {e.value for e in added} == {keys[i][1] for i in bad} - {keys[bad[0]][1], keys[bad[5]][1]}
    assert all(e.kind == "origin" and e.reason.startswith("looks like /data/licences.txt:") for e in added)
    assert {e.job for e in added} == {"j"} and {e.step for e in added} <= {12, 40}
    assert out.match(origin=keys[bad[3]][1]) == "origin" and out.match(origin=keys[8][1]) is None
    # nothing atypical held: nothing follows
    assert QuarantineList(q.entries[2:]).with_lookalikes(rows, keys).entries == q.entries[2:]


def test_a_look_alike_without_origin_or_id_is_counted_not_guessed() -> None:
    rows = _text_rows(120)
    for i in (3, 50, 90):
        rows[i] = _utf16(rows[i])
    keys = [(f"id{i}" if i != 90 else None, None, None) for i in range(120)]
    out = QuarantineList((QuarantineEntry(kind="sample", value="id3"),)).with_lookalikes(rows, keys)
    assert [(e.kind, e.value) for e in out.entries[1:]] == [("sample", "id50")]
    assert out.unnamed_lookalikes == 1


@pytest.mark.parametrize("bad", [dict(min_similarity=0.0), dict(min_similarity=1.5), dict(min_atypical_z=0),
                                 dict(buckets=1), dict(buckets=2.5)])
def test_bad_settings_are_refused_on_construction(bad: dict) -> None:
    with pytest.raises(ValueError):
        LookalikeConfig(**bad)


def test_rows_and_keys_must_match() -> None:
    with pytest.raises(ValueError, match="same length"):
        lookalike.find([[1, 2]], [], lambda k: False)


def test_the_extended_list_goes_back_into_the_store_and_out_again(tmp_path: Path) -> None:
    db, saved, again = tmp_path / "q.db", tmp_path / "extended.jsonl", tmp_path / "again.jsonl"
    with IncidentStore(db) as store:
        store.quarantine.add([QuarantineEntry(kind="origin", value="f:3", reason="culprit", job="j", step=5)])
    runner = CliRunner()
    assert runner.invoke(main, ["quarantine", "export", "--db", str(db), str(again)]).exit_code == 0
    rows = _text_rows(120)
    for i in (3, 50, 90):
        rows[i] = _utf16(rows[i])
    q = QuarantineList.load(again).with_lookalikes(rows, [(None, f"f:{i}", "legal") for i in range(120)])
    q.save(saved)
    with saved.open("a", encoding="utf-8") as f:
        f.write('{"kind": "planet", "value": "x"}\nnot json\n')
    res = runner.invoke(main, ["quarantine", "import", "--db", str(db), str(saved)])
    assert res.exit_code == 0, res.output
    assert "2 entries added, 1 already quarantined, 2 lines skipped" in res.output
    assert "line 4 skipped" in res.output and "line 5 skipped" in res.output
    listed = json.loads(runner.invoke(main, ["quarantine", "list", "--db", str(db), "--json"]).output)
    assert {(e["value"], e["job"]) for e in listed} == {("f:3", "j"), ("f:50", "j"), ("f:90", "j")}
    assert QuarantineList.from_store(db).match(origin="f:90") == "origin"
