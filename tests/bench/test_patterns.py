"""The patterns benchmark (``python -m bench patterns``, bench/patterns.py): its data are real rows that name their
file and line and carry their faults every time they are drawn; its quick run follows flags back to rows, exports
the quarantine and restarts through the loader helper, and its counts agree with each other."""
from __future__ import annotations

import pytest

datasets = pytest.importorskip("datasets")
pytest.importorskip("transformers")
datasets.disable_progress_bars()

from bench.patterns_data import FAULTS, KINDS, dataset, held_out, pick, resolve  # noqa: E402
from tests.bench.test_bench_smoke import run_bench  # noqa: E402

LIMIT = 400_000  # bytes of files per kind: a small pool, a few seconds


def test_rows_name_their_file_and_line_and_faults_belong_to_rows():
    mix = pick(0, 40, 128, 0.05, limit=LIMIT)
    assert set(mix.rows) == set(KINDS) and all(len(r) == 40 for r in mix.rows.values())
    assert len(mix.faulty_sources) == 2 and len(pick(1, 40, 128, 0.05, limit=LIMIT).faulty_sources) == 1
    assert len(mix.faults) == 4 and {mix.origins[o] for o in mix.faults} == set(mix.faulty_sources)
    assert set(mix.faults.values()) <= set(FAULTS)
    for kind, rows in mix.rows.items():  # every origin reads back the bytes of its row from the file
        for origin, clean in rows[:8] + [(o, b) for o, b in rows if o in mix.faults]:
            assert resolve(kind, origin, 129) == clean, origin
    assert resolve("code", mix.rows["code"][0][0] + "0000", 129) is None  # a line past the file's end
    ds = dataset(mix)
    assert len(ds) == 160 and {"gradloc_source", "gradloc_origin", "input_ids", "labels"} <= set(ds.column_names)
    again = dataset(mix)  # a faulty row is the same every time it is built (and drawn)
    for i, origin in enumerate(ds["gradloc_origin"]):
        row = ds[i]
        assert again[i]["input_ids"] == row["input_ids"]
        clean = next(b for o, b in mix.rows[row["gradloc_source"]] if o == origin)
        fault = mix.faults.get(origin)
        if fault is None:
            assert bytes(row["input_ids"]) == clean[:-1] and bytes(row["labels"]) == clean[1:]
        elif fault == "mis_labelled":
            assert row["labels"] == row["input_ids"] and bytes(row["input_ids"]) == clean[:-1]
        else:
            assert bytes(row["input_ids"]) != clean[:-1] and row["labels"][:-1] == row["input_ids"][1:]
    pre = held_out(mix, 128, LIMIT)  # pre-training text: the same kinds, none of the mixture's rows
    taken = {b for rows in mix.rows.values() for _, b in rows}
    assert all(pre[k] for k in KINDS) and not taken & {b for k in KINDS for b in pre[k]}


@pytest.mark.slow
def test_the_quick_run_follows_flags_to_rows_and_the_restart_keeps_the_quarantine_out():
    out = run_bench("patterns", "--quick", "--json")
    (run,) = out["runs"]
    for key in ("ranking", "flags", "flagged_rows", "quarantine", "restart", "incidents", "faulty_sources", "z"):
        assert key in run, key
    assert run["agent_dropped"] == 0 and run["restart"]["agent_dropped"] == 0
    outliers = run["flags"]["outlier"]
    assert outliers["flags"] >= 1  # something was flagged
    # every flag names the row fed at its (step, micro-batch, sample), and that row reads back from its file
    for what in ("outlier", "culprit"):
        c = run["flags"][what]
        assert c.get("fed", 0) == c.get("resolves", 0) == c.get("flags", 0), (what, c)
    rk = run["ranking"]
    assert set(rk["order"]) == set(KINDS) and all(rk["sources"][k]["tokens"] > 0 for k in KINDS)
    flagged = sum(s["outliers"] + s["culprits"] for s in rk["sources"].values())
    assert flagged == outliers["flags"] + run["flags"]["culprit"].get("flags", 0)
    q, rs = run["quarantine"], run["restart"]
    assert q["entries"] >= 1 and q["faulty"] + q["clean"] + q["unknown"] == q["entries"]
    # the restart: the exported list is the store's, and the two loader helpers agree on it
    assert rs["exported"] == q["entries"] and rs["bad_lines"] == 0
    assert sum(rs["skipped"].values()) == rs["quarantined_rows"] == sum(rs["filter_dataset_skipped"].values())
    assert rs["sampler_len"] == rs["filter_dataset_kept"] == run["rows"] - rs["quarantined_rows"] == rs["draws"]
    assert rs["quarantined_drawn"] == 0 and rs["drawn_outside"] == 0
    assert rs["clean_drawn"] == rs["clean_expected"] and rs["clean_drawn_twice"] == 0
    la = rs["lookalikes"]  # rows that look like quarantined ones: added to the list and imported into the store
    assert la["faulty"] + la["clean"] == la["added"] and sum(la["by_fault"].values()) == la["faulty"]
    assert la["imported"].startswith(f"{la['added']} entr") and la["imported"].endswith(", 0 lines skipped")
    # the faulty rows neither quarantined nor look-alikes, once each
    assert rs["faulty_drawn"] == q["faulty_total"] - q["faulty"] - la["faulty"]
    t = out["total"]
    assert t["seeds"] == 1 and t["restart"]["quarantined_drawn"] == 0
