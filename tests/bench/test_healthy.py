"""``python -m bench healthy`` (false incidents on healthy natural-text runs, recall on injected
faults) and the natural-text setup it shares (``bench/natural.py``). The full run's numbers are in
docs/BENCHMARKS.md; here a quick run (one thread, ~30 s) and the pieces.
"""
from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch  # noqa: E402

from bench.healthy import HealthyConfig, check_replay, fault_schedule, replay, train  # noqa: E402
from bench.natural import Run, RunConfig, natural_corpus  # noqa: E402
from bench.natural_faults import FAULTS, inject  # noqa: E402
from gradloc.config import DetectorConfig  # noqa: E402
from tests.bench.test_bench_smoke import run_bench  # noqa: E402

TINY = RunConfig(d_model=32, n_layers=1, seq=32, batch=2, steps=60)


@pytest.fixture(autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def test_healthy_quick_json():
    res = run_bench("healthy", "--quick", "--json", timeout=300)
    assert res["replay_matches_live"] is True
    assert list(res["settings"]) == list(DetectorConfig.SENSITIVITIES)
    s = res["settings"]
    for name, row in s.items():
        assert row["healthy_steps"] == 150 and row["false_incidents"] >= 0
        assert set(row["recall"]) <= set(FAULTS) and set(row["injected"]) == set(row["recall"])
    assert s["default"]["recall"]["planted_token"] == 1.0
    assert s["high"]["recall"]["planted_token"] == 1.0  # an earlier false incident's episode does not hide it
    assert s["default"]["false_incidents"] <= s["high"]["false_incidents"] < s["zclip"]["false_incidents"]
    assert s["low"]["false_incidents"] <= s["default"]["false_incidents"]
    (run,) = res["runs"]
    assert run["family"] == "qwen2" and run["steps"] == 150 and run["params"] > 0
    assert run["live_incidents"] == run["incidents"]["default"]["count"]  # the live monitor runs the default
    x = run["extremes"]
    assert x["norm_ratio_max"] >= x["norm_ratio_top3"][-1] > 0 and x["norm_z_max"] >= x["norm_z_q999"]
    # zclip keeps ZClip's own statistics (issue 32), so its z is not the default's: both see z > 2.5 steps
    assert x["steps_over_2_5_z"] > 0 and s["zclip"]["kinds"].get("grad_spike", 0) > 0
    sig = res["fault_signals"]
    assert set(sig) == set(s["default"]["injected"])
    lo, mid, hi = sig["planted_token"]["top_share"]
    assert lo <= mid <= hi and lo >= 0.5  # a planted token carries most of its step's gradient
    assert res["setup"]["corpus"]["tokens"] > 100_000
    # the live drift detector's findings: 150 steps are all inside its warm-up, so none is judged
    assert run["precursors"]["judged_steps"] == 0 and run["precursors"]["count"] == 0
    assert res["precursors"] == dict(judged_steps=0, findings=0, findings_per_1000=0.0, pages=0, runs_over_1_per_1000=0)


def test_replay_of_a_trace_must_match_its_live_monitor():
    trace = train(TINY)
    assert trace.live_config == DetectorConfig().resolved()
    check_replay([trace])  # the live monitor's own config opens the same incidents
    assert [s for s, _ in replay(trace, DetectorConfig())] == trace.live_incidents
    forged = dataclasses.replace(trace, live_incidents=trace.live_incidents + [59])
    with pytest.raises(AssertionError, match="replay"):
        check_replay([forged])


def test_a_step_s_data_depends_only_on_seed_and_step():
    a, a2, b = Run(TINY), Run(TINY), Run(dataclasses.replace(TINY, seed=1))
    try:
        for _ in range(3):
            a.step()  # training does not move the data of later steps
        torch.testing.assert_close(a.batch(7).windows, a2.batch(7).windows, rtol=0, atol=0)
        assert not torch.equal(a.batch(7).windows, b.batch(7).windows)
        assert not torch.equal(a.batch(7).windows, a.batch(8).windows)
    finally:
        for r in (a, a2, b):
            r.close()


@pytest.mark.parametrize("kind", FAULTS)
def test_inject_changes_one_sample_of_the_step(kind):
    run = Run(TINY)
    try:
        healthy, batch = run.batch(3), run.batch(3)
        fault = inject(kind, batch, torch.Generator().manual_seed(0), run.model, run.corpus, 3)
        assert fault.kind == kind and fault.step == 3
        assert fault.sample_id == batch.sample_ids[fault.micro_batch][fault.sample]
        M, B, _ = batch.weights.shape
        changed = set()
        for m in range(M):
            x_diff = (batch.windows[m] != healthy.windows[m]).any(-1)
            y_diff = (batch.targets(m) != healthy.targets(m)).any(-1)
            w_diff = (batch.weights[m] != healthy.weights[m]).any(-1)
            changed |= {(m, b) for b in range(B) if x_diff[b] or y_diff[b] or w_diff[b]}
        assert changed == {(fault.micro_batch, fault.sample)}
    finally:
        run.close()


def test_fault_schedule_spaces_the_faults_and_takes_turns():
    cfg = HealthyConfig()
    sched = fault_schedule(cfg, 0)
    steps = sorted(sched)
    assert steps[0] == cfg.fault_after and steps[-1] < cfg.fault_steps
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    assert min(gaps) >= 0.75 * cfg.fault_every and max(gaps) <= 1.25 * cfg.fault_every
    kinds = [sched[s] for s in steps]
    assert set(kinds[: len(FAULTS)]) == set(FAULTS)  # every kind once before any repeats
    assert fault_schedule(cfg, 0) == sched and fault_schedule(cfg, 1) != sched


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = RunConfig(steps=1000, lr=1e-3, lr_warmup=100, min_lr_ratio=0.1)
    assert cfg.lr_at(0) == pytest.approx(1e-5) and cfg.lr_at(99) == pytest.approx(1e-3)
    assert cfg.lr_at(550) == pytest.approx(0.55e-3)
    assert cfg.lr_at(1000) == pytest.approx(1e-4)


def test_natural_corpus_is_natural_text():
    corpus = natural_corpus(2048)
    assert corpus.vocab == 2048 and corpus.documents > 1000 and len(corpus.ids) > 100_000
    text = corpus.to_text(corpus.ids[:2000].tolist())
    assert text.count(" the ") > 10  # English prose, not code or random ids
    assert corpus.to_text(corpus.encode("Return the value.")) == "Return the value."


def test_reused_traces_are_loaded_not_trained(tmp_path, monkeypatch):
    """``--reuse-traces``: a run already in the traces directory is loaded (more seeds added to a measured set);
    the summary is the same as the run that trained it, and says which traces it reused."""
    import bench.healthy as healthy

    cfg = HealthyConfig(families=("qwen2",), seeds=1, steps=60, fault_steps=0, run=TINY)
    first = healthy.run_healthy(cfg, traces=str(tmp_path))
    assert first["setup"]["reused_traces"] == [] and (tmp_path / "healthy-qwen2-0.pkl").exists()
    monkeypatch.setattr(healthy, "train", lambda *a, **k: pytest.fail("a reused run was trained again"))
    again = healthy.run_healthy(cfg, traces=str(tmp_path), reuse=True)
    assert again["setup"]["reused_traces"] == ["healthy-qwen2-0.pkl"]
    assert again["settings"] == first["settings"] and again["replay_matches_live"] is True


def test_healthy_ddp_quick_json():
    """``--ddp 2``: a 2-rank DDP job (its defaults) on natural text; the ranks report the same job-wide precursor
    values every step after the first, the same incidents and findings (none judged in 30 steps: the warm-up);
    ``--drift`` replays the job's findings under other settings."""
    res = run_bench("healthy", "--ddp", "2", "--quick", "--steps", "30", "--json", "--drift", "z_threshold=4",
                    "warmup=20", timeout=300)
    (job,) = res["jobs"]
    assert job["job_kind"] == "ddp" and job["steps"] == 30 and job["series"] >= 5  # head, norm, attention...
    assert job["values_agree_after_step_0"] and job["incidents_agree"] and job["findings_agree"]
    for r in job["ranks"]:
        assert r["precursors"]["judged_steps"] == 0 and r["precursors"]["count"] == 0
        assert not {k for k in r["counters"] if k.endswith("errors")}, r["counters"]
    assert res["world_size"] == 2 and res["precursors"]["judged_steps"] == 0
    # --drift: the job's findings replayed under other settings (after the replay at the defaults matched live)
    assert res["drift_replayed"]["settings"]["z_threshold"] == 4 and res["drift_replayed"]["judged_steps"] == 10
    assert job["replayed"]["judged_steps"] == 10


def test_the_drift_replay_over_a_healthy_run_makes_its_live_findings(tmp_path):
    """``bench healthy --drift``: the drift detector replayed over a run's step records (bench/drift_rates.replay,
    the monitor's own path) makes the live findings at the live settings, other findings at others; a trace whose
    live findings were not these fails the check (a replay that measured nothing real)."""
    from dataclasses import replace as dc_replace

    from bench import drift_rates
    from bench.healthy import summarize
    from gradloc.config import DriftConfig, PrecursorConfig

    talk = DriftConfig(warmup=16, reference=16, window=8, patience=2, z_threshold=0.5, min_change=1.01, tau=0.0,
                       page_steps=8, references=())
    trace = train(TINY, precursors=PrecursorConfig(drift=talk))
    live = [f for r in trace.records for f in r.precursor_findings]
    assert trace.live_drift == talk and len(live) >= 2, len(live)  # the run speaks: something to compare
    assert len(drift_rates.check_replay(trace.records, talk, "tiny")) == len(live)
    assert drift_rates.replay(trace.records, dc_replace(talk, z_threshold=1e6)) == []
    res = summarize(HealthyConfig(families=("qwen2",), seeds=1, steps=60, fault_steps=0, settings=("default",),
                                  run=TINY), [trace], [], drift=dc_replace(talk, z_threshold=1e6))
    assert res["precursors"]["findings"] == len(live) and res["replay_matches_live"] is True
    quiet = res["drift_replayed"]  # the replay follows its own settings, not the live run's
    assert quiet["settings"]["z_threshold"] == 1e6 and quiet["judged_steps"] == 60 - 16 and quiet["findings"] == 0
    assert res["runs"][0]["precursors_replayed"]["count"] == 0
    at = next(i for i, r in enumerate(trace.records) if r.precursor_findings)
    trace.records[at] = dc_replace(trace.records[at], precursor_findings=())  # live findings that are not the replay's
    with pytest.raises(AssertionError, match="not the live ones"):
        summarize(HealthyConfig(families=("qwen2",), seeds=1, steps=60, fault_steps=0, settings=("default",),
                                run=TINY), [trace], [])


def test_healthy_drift_flag_is_checked():
    for bad in (["--drift", "z=1"], ["--drift", "window=0"], ["--drift", "enabled=false"]):
        with pytest.raises(SystemExit):
            from bench.__main__ import main

            main(["healthy", "--quick", *bad])
