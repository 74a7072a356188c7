"""The monitor's drift findings (engine/drift.py): a real model whose one attention layer's logits grow step after
step gets a ``precursor`` finding naming that layer, with the samples behind its largest logits; the drivers'
(micro-batch, row, position) resolve to sample ids on packed and unpacked micro-batches; a failing detector is
counted, never raised."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch

import gradloc
from gradloc.collector.batch import make_meta
from gradloc.config import DriftConfig, PrecursorConfig, WatchConfig
from gradloc.engine.drift import DriftWatch, JobShare, driver, observations
from gradloc.records import PrecursorStat, RLStats, Trend
from tests.builders import step_record

pytest.importorskip("transformers")
from tests.collector.rules.hf_zoo import build  # noqa: E402

B, T = 2, 16
FAST = DriftConfig(warmup=0, reference=16, window=8, patience=3, z_threshold=3.0, min_change=1.2, references=())


def test_a_layer_whose_attention_logits_grow_is_named_with_its_samples(tmp_path) -> None:
    model = build("gpt2")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the numbers move only where the test moves them
    db = tmp_path / "drift.db"  # embedded mode: the findings reach the store the way a run's records do
    mon = gradloc.watch(model, opt, config=WatchConfig(job="drift", store_path=str(db), token_stats=False,
                                                       precursors=PrecursorConfig(drift=FAST)))
    g = torch.Generator().manual_seed(0)
    q = model.transformer.h[1].attn.c_attn.weight  # Conv1D (64, 3 × 64): q is the first 64 output columns
    found = []
    try:
        for s in range(48):
            for m in range(2):
                ids = torch.randint(0, 256, (B, T), generator=g)
                with mon.micro_batch(ids[:, 1:], sample_ids=[f"s{s}-{m}-{b}" for b in range(B)]):
                    logits = model(ids[:, :-1]).logits  # (B, T − 1, V)
                    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                             ids[:, 1:].reshape(-1))
                    loss.backward()
            rep = mon.end_step(loss)
            found += rep.record.precursor_findings
            opt.zero_grad()
            if s >= 28:
                with torch.no_grad():
                    q[:, :64] *= 1.1  # layer 1's attention logits grow ×1.1 a step from here
        counters = dict(mon.counters)
    finally:
        mon.close()
    rising = [f for f in found if f.statistic == "attn_max_logit"]
    assert rising and {f.layer for f in rising} == {"transformer.h.1.attn"}, found
    f = rising[0]
    assert f.trend == Trend.RISING and 28 < f.step <= 44 and f.since_step >= 28 and f.change >= 1.2
    assert f.drivers and all(d.sample_id == f"s{d.step}-{d.micro_batch}-{d.sample}" for d in f.drivers)
    assert all(0 <= d.position < T - 1 for d in f.drivers)
    assert all(x.layer == "transformer.h.1.attn" for x in found if x.statistic.startswith("attn_"))
    assert counters["precursor_findings"] == len(found) and not counters.get("drift_errors")
    from gradloc.store.sqlite import IncidentStore

    with IncidentStore(db, create=False) as store:
        stored = store.list_precursor_findings(job="drift", limit=None)
    assert sorted((x.step, x.statistic, x.layer) for x in stored) == sorted((x.step, x.statistic, x.layer) for x in found)
    assert {d.sample_id for x in stored for d in x.drivers} == {d.sample_id for x in found for d in x.drivers}


def test_drivers_resolve_packed_and_unpacked_samples() -> None:
    flat = make_meta(0, torch.zeros(2, 8, dtype=torch.long), None, ["a", "b"], None)
    packed = make_meta(1, torch.zeros(1, 10, dtype=torch.long), None, ["x", "y", "z"], None, cu_seqlens=[0, 3, 7, 10])
    metas = {0: flat, 1: packed}
    d = driver(5, 2.0, (0, 1, 6), metas)
    assert (d.sample, d.position, d.sample_id) == (1, 6, "b")
    d = driver(5, 2.0, (1, 0, 8), metas)  # packed: flat position 8 is sequence z's position 1
    assert (d.sample, d.position, d.sample_id) == (2, 1, "z")
    d = driver(5, 2.0, (7, 1, 2), metas)  # a micro-batch the step does not have: raw location, no id
    assert (d.micro_batch, d.sample, d.position, d.sample_id) == (7, 1, 2, None)
    assert driver(5, 2.0, None, metas) is None


def test_rl_and_update_ratio_series_are_observed() -> None:
    rec = step_record()
    rec = replace(rec, precursors=(PrecursorStat(kind="attn_entropy", layer="a", value=1.0, at=(0, 0, 1)),),
                  rl=RLStats(tokens=10, entropy_mean=0.7, kl_rollout=0.01),
                  layers=tuple(replace(x, update_ratio=1e-3) for x in rec.layers))
    got = {(o.statistic, o.layer): o for o in observations(rec, [])}
    assert got[("attn_entropy", "a")].driver.position == 1
    assert got[("rl_entropy", "")].value == 0.7 and got[("rl_kl_rollout", "")].value == 0.01
    assert sum(k[0] == "update_ratio" for k in got) == len(rec.layers)


def test_a_failing_detector_is_counted_and_the_record_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    counters: Counter[str] = Counter()
    watch = DriftWatch(DriftConfig(), counters)

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(watch.detector, "observe", boom)
    rec = step_record()
    assert watch.watch_step(rec, []) is rec and counters["drift_errors"] == 1
    assert DriftWatch(DriftConfig(enabled=False), counters).watch_step(rec, []) is rec


def test_a_job_wide_finding_is_kept_by_the_rank_holding_its_driver_with_that_rank_s_sample_ids() -> None:
    """Under DDP/FSDP2 every rank judges the job's values (collector/precursors/job.py) and finds the same; the rank
    whose micro-batch holds the finding's most extreme driver keeps it (it alone knows the sample ids), the others
    count it; a rank's own series (RL entropy) stay each rank's."""
    def run(rank: int) -> tuple[list, Counter]:
        counters: Counter[str] = Counter()
        watch = DriftWatch(FAST, counters)
        found = []
        for s in range(48):
            grow = 1.0 if s < 28 else 1.1 ** (s - 27)
            rec = replace(step_record(step=s, rank=rank), precursors=(
                PrecursorStat(kind="attn_max_logit", layer="h.1.attn", value=5.0 * grow + 0.01 * (s % 3),
                              at=(1, 0, s % 8), rank=1),),
                rl=RLStats(tokens=10, entropy_mean=2.0 if rank == 0 or s < 28 else 2.0 / grow))
            metas = [make_meta(m, torch.zeros(2, 8, dtype=torch.long), None,
                               [f"r{rank}-s{s}-{m}-{b}" for b in range(2)], None) for m in range(2)]
            found += watch.watch_step(rec, metas, JobShare(rank=rank, precursors=True)).precursor_findings
        return found, counters

    (found0, counters0), (found1, counters1) = run(0), run(1)
    assert [f.statistic for f in found1 if f.statistic != "rl_entropy"] == ["attn_max_logit"]
    f = next(f for f in found1 if f.statistic == "attn_max_logit")
    assert f.drivers and all(d.rank == 1 and d.sample_id == f"r1-s{d.step}-1-0" for d in f.drivers)
    assert not [f for f in found0 if f.statistic == "attn_max_logit"]
    assert counters0["precursor_findings_elsewhere"] >= 1 and not counters1["precursor_findings_elsewhere"]
    assert [f.statistic for f in found1 if f.statistic == "rl_entropy"] == ["rl_entropy"]  # rank 1's own fall
    assert not [f for f in found0 if f.statistic == "rl_entropy"]


def test_a_driver_on_another_rank_names_the_rank_and_no_sample_id() -> None:
    metas = {0: make_meta(0, torch.zeros(2, 8, dtype=torch.long), None, ["a", "b"], None)}
    rec = replace(step_record(), precursors=(
        PrecursorStat(kind="attn_max_logit", layer="x", value=3.0, at=(0, 1, 2), rank=1),
        PrecursorStat(kind="attn_max_logit", layer="y", value=3.0, at=(0, 1, 2), rank=0)))
    got = {o.layer: o.driver for o in observations(rec, list(metas.values()), JobShare(rank=0, precursors=True))}
    assert (got["x"].rank, got["x"].sample, got["x"].sample_id) == (1, 1, None)
    assert (got["y"].rank, got["y"].sample, got["y"].sample_id) == (0, 1, "b")


def test_the_job_s_rl_entropy_and_replicated_update_ratios_are_reported_by_rank_0_only() -> None:
    """Every rank judges the job's policy entropy (rl_fields.job_rl, from the step gather) and, under data
    parallelism alone, the same update ratios: rank 0 reports, the others count; the record's own RL stats are not
    what is judged."""
    def run(rank: int) -> tuple[list, Counter]:
        counters: Counter[str] = Counter()
        watch = DriftWatch(FAST, counters)
        found = []
        for s in range(48):
            fall = 1.0 if s < 28 else 1.1 ** (s - 27)
            rec = step_record(step=s, rank=rank)
            rec = replace(rec, rl=RLStats(tokens=10, entropy_mean=5.0),  # this rank's own: flat
                          layers=tuple(replace(x, update_ratio=1e-3 * fall * (1 + 0.01 * (s % 3))) for x in rec.layers))
            job = JobShare(rank=rank, rl=(2.0 / fall + 0.001 * (s % 3), None), ratios=True)
            found += watch.watch_step(rec, [], job).precursor_findings
        return found, counters

    (found0, counters0), (found1, counters1) = run(0), run(1)
    assert {f.statistic for f in found0} == {"rl_entropy", "update_ratio"} and not found1
    assert counters1["precursor_findings_elsewhere"] == len(found0) and not counters0["precursor_findings_elsewhere"]
