"""Real data faults in a model-parallel job, not planted weights: a long healthy run, then bad samples.

The model-parallel demo's job (gradloc/demo/parallel.py ``run_rank``: ParallelGPT on the demo's cl100k text,
gradloc at its default detector and sample settings, but ``alpha`` 0.9 as in the demo) trains on 4 gloo ranks,
2 pipeline stages × FSDP2 dp 2 (``pp``) or FSDP2 × TP on a (dp 2, tp 2) mesh (``fsdp-tp``). Data rank 1's data
goes bad twice, the way real data breaks (bench/faults.py's kinds): at step ``GARBAGE`` one sample is uniformly
random ids (binary garbage), at step ``SHIFTED`` one sample's labels are the token 5 positions later. Neither adds
a loss weight, and one bad sample among a data rank's 16 need not move the step's gradient: what must catch them
is the per-sample surprise, read off the column-parallel or last-stage loss head. Checked:

- each bad sample is a ``surprise`` outlier on its step, named by its micro-batch and sample, by the one rank that
  judges data rank 1's samples (the head's holder: the last stage's rank, or the first tp rank);
- the garbage also spikes its step: every rank holds one job incident there, located on that sample of data rank
  1 and naming nothing else (as would any fault step that spikes);
- nothing else is flagged: no outlier on any other step or rank, no incident on a healthy step before the faults
  (past the detector's warm-up), across the whole healthy run of every rank.
"""
from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.launch import run

STEPS, GARBAGE, SHIFTED = 72, 52, 64
FAULTS = {GARBAGE: (1, 2, "random_ids"), SHIFTED: (3, 0, "shifted_labels_5")}  # step -> (micro-batch, sample, kind)
BAD_DP_RANK = 1


def _job(rank: int, world: int, backend: str) -> dict[str, Any]:
    import torch

    import gradloc
    from gradloc.demo.data import cl100k_corpus
    from gradloc.demo.parallel import data_rank, run_rank
    from gradloc.demo.run import DemoConfig

    corpus = cl100k_corpus()
    cfg = DemoConfig(steps=STEPS, inject="none", inject_step=GARBAGE, world_size=world, rank=rank, backend=backend)
    dp_rank = data_rank(backend, rank, world)
    bad = torch.Generator().manual_seed(7)  # the faults' own draws: the healthy data stays the same
    step = [0]

    def batches(gen: torch.Generator) -> list:
        mbs = [corpus.windows(gen, cfg.batch, cfg.seq) for _ in range(cfg.micro_batches)]  # M × (x, y, starts)
        s, step[0] = step[0], step[0] + 1
        if dp_rank == BAD_DP_RANK and s in FAULTS:
            i, b, kind = FAULTS[s]
            x, y, starts = mbs[i][0].clone(), mbs[i][1].clone(), mbs[i][2]
            if kind == "random_ids":  # garbage: inputs and labels one random window, labels the next id
                window = torch.randint(0, corpus.vocab, (cfg.seq + 1,), generator=bad)
                x[b], y[b] = window[:-1], window[1:]
            else:  # shifted labels: each label is the token 5 positions later (the window's tail wraps round)
                y[b] = torch.roll(y[b], -5)
            mbs[i] = (x, y, starts)
        return mbs

    flagged, judged, tokens = [], [], 0

    def on_step(s: int, record: Any) -> None:
        nonlocal tokens
        tokens += sum(g.tokens for g in record.groups if g.kind == "source")
        if record.samples is not None:
            judged.append(record.samples.judged)
            flagged.extend((s, str(o.kind), o.micro_batch, o.sample, round(o.z, 1)) for o in record.samples.outliers)

    mon, _ = run_rank(cfg, corpus.vocab, on_step, batches,
                      lambda model, opt: gradloc.watch(model, opt, store=False,
                                                       detector=gradloc.DetectorConfig(alpha=cfg.detector_alpha)))
    incidents = [(i.step, i.localization.status.value, sorted({(c.rank, c.micro_batch, c.sample) for c in
                                                              (*i.localization.culprits, *i.localization.spans)}))
                 for i in mon.incidents]  # (step, status, the (data rank, micro-batch, sample) it names)
    return {"rank": rank, "dp_rank": dp_rank, "flagged": flagged, "judged": sum(judged), "tokens": tokens,
            "step_tokens": cfg.micro_batches * cfg.batch * (cfg.seq - cfg.prompt),
            "warmup": mon.config.detector.warmup, "incidents": incidents,
            "errors": {k: v for k, v in mon.counters.items() if k.endswith("errors") and v}}


@pytest.mark.parametrize("backend", ["pp", "fsdp-tp"])
def test_bad_samples_on_a_data_rank_are_flagged_there_and_nothing_else_is(backend: str) -> None:
    results = run(_job, 4, backend, timeout_s=600)
    judges = [r for r in results if r["judged"]]
    assert len(judges) == 2 and sorted(r["dp_rank"] for r in judges) == [0, 1]  # one judging rank per data index
    # the data's tokens per source: counted by the judging rank of each data index only (the job's sum is exact)
    assert all(r["tokens"] == (STEPS * r["step_tokens"] if r["judged"] else 0) for r in results), results
    for r in results:
        assert r["errors"] == {}, r
        early = [s for s, *_ in r["incidents"] if r["warmup"] <= s < GARBAGE]
        assert early == [], f"rank {r['rank']}: incidents on healthy steps {r['incidents']}"
        garbage = (GARBAGE, "located", [(BAD_DP_RANK, *FAULTS[GARBAGE][:2])])  # the garbage spikes the step too
        assert [i for i in r["incidents"] if i[0] == GARBAGE] == [garbage], r["incidents"]
        for s, status, named in r["incidents"]:  # any fault step that spikes: located on its own sample, nothing else
            if s in FAULTS:
                assert status == "located" and named == [(BAD_DP_RANK, *FAULTS[s][:2])], r["incidents"]
        if r["dp_rank"] != BAD_DP_RANK or not r["judged"]:
            assert r["flagged"] == [], f"rank {r['rank']} flagged healthy samples: {r['flagged']}"
            continue
        got = {s: (mb, sample) for s, kind, mb, sample, _ in r["flagged"] if kind == "surprise"}
        assert got == {s: (mb, sample) for s, (mb, sample, _) in FAULTS.items()}, r["flagged"]
