"""``python -m bench compare``: the same verdicts or the paths that differ (issue 34's behaviour check)."""
from __future__ import annotations

import json

from bench.compare import diff, main


def test_the_same_document_up_to_timings_and_the_tolerance_is_the_same():
    a = {"recall": 1.0, "runs": [{"probes": 3, "share": 0.25, "culprits": [[0, 1, 2]]}], "wall_s": 10.0}
    b = {"recall": 1.0, "runs": [{"probes": 3, "share": 0.25 + 5e-7, "culprits": [[0, 1, 2]]}], "wall_s": 99.0}
    assert list(diff(a, b, 1e-6, frozenset({"wall_s"}))) == []


def test_every_kind_of_difference_is_named_with_its_path(tmp_path, capsys):
    a = {"runs": [{"probes": 3, "share": 0.25, "status": "located", "culprits": [[0, 1]]}], "n": 2, "gone": 1}
    b = {"runs": [{"probes": 2, "share": 0.2501, "status": "diffuse", "culprits": [[0, 1], [1, 1]]}], "n": 2.0}
    got = list(diff(a, b, 1e-6, frozenset()))
    assert got == [".gone: present in the baseline, missing in the new run", ".runs[0].culprits: 1 items != 2 items",
                   ".runs[0].probes: 3 != 2", ".runs[0].share: 0.25 != 0.2501", ".runs[0].status: 'located' != 'diffuse'"]
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert main([str(pa), str(pb)]) == 1 and main([str(pa), str(pa)]) == 0
    assert main([str(pa), str(pb), "--ignore", "runs", "--ignore", "gone"]) == 0
    assert "5 difference(s)" in capsys.readouterr().err


def test_it_runs_as_python_m_bench_compare(tmp_path):
    """One entry point: ``python -m bench compare`` hands its arguments to bench/compare.py's main."""
    import bench.__main__ as entry

    p = tmp_path / "a.json"
    p.write_text(json.dumps({"x": 1}))
    q = tmp_path / "b.json"
    q.write_text(json.dumps({"x": 2}))
    assert entry.main(["compare", str(p), str(p)]) == 0 and entry.main(["compare", str(p), str(q)]) == 1
    assert set(entry.DELEGATED) == {"samples", "faults", "compare", "compile-guards", "deepspeed-grads", "patterns",
                                   "precursors"}
