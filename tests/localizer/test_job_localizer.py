"""The one localizer on W = 2 ranks (DDP's scope, in-process ranks: tests/localizer/fake_comm.py),
each decision branch checked against the same localizer on W = 1 over the job's whole data.

A DDP job's gradient is the ranks' average, ∇ = (∇_0 + ∇_1) / 2, so the reference is one process
holding every micro-batch (rank r's micro-batch m is its micro-batch r·M + m) with every token
vector halved: shares are scale-free, norms and the healthy level halve with it.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from gradloc.config import LocalizerConfig, WatchConfig
from gradloc.localizer.localizer import Localizer, StoredGradient
from gradloc.localizer.scope import ProbeFailed
from gradloc.parallel.data import DDP
from gradloc.parallel.job import Job
from gradloc.parallel.layout import Layout
from gradloc.parallel.scope import JobScope
from tests.helpers import single_thread  # noqa: F401
from tests.localizer.fake_comm import FakeJob
from tests.localizer.toy import Toy, basis, ctx, planted

D, M, W = 8, 3, 2


class _DDP(DDP):
    """DDP's scope without a wrapper to ask for ``no_sync`` (the toy's backward never all-reduces)."""

    def probe_context(self):  # noqa: ANN201
        return contextlib.nullcontext()


def DDPScope(*, comm, model, params, metas, probe, pause_hooks, probe_context, grads, inv_scale, norm):  # noqa: N802
    """DDP's job scope over the in-process ranks' communicator (the data group and the world alike)."""
    job = Job(model, model, WatchConfig(), comm, _DDP(None), layout=Layout.flat(comm))
    return JobScope(job=job, params=params, metas=metas, probe=probe, pause_hooks=pause_hooks, grads=grads,
                    inv_scale=inv_scale, norm=norm)


def decode(ids: list[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


def run_job(toys: list[Toy], context, cfg: LocalizerConfig | None = None, *, probes=(True, True), views=None,
            closures=(None, None)):
    g = sum(t.grad_of() for t in toys) / len(toys)  # DDP: the averaged gradient, on every rank
    norm = float(g.norm())
    job = FakeJob(len(toys))

    def rank(r: int):
        toy = toys[r]
        scope = DDPScope(comm=job.comm(r), model=toy.model, params=[toy.w], metas=toy.metas,
                         probe=closures[r] or toy.probe, pause_hooks=lambda on: None,
                         probe_context=contextlib.nullcontext, grads=[g.clone()], inv_scale=1.0, norm=norm)
        view = toy.view() if views is None else views[r]
        return Localizer(cfg or LocalizerConfig(), decode).localize(
            7, view, StoredGradient([g.clone()], 1.0, norm), scope, context, has_probe=probes[r])

    results = job.run(rank)
    assert repr(results[0].localization) == repr(results[1].localization)  # every rank: the same answer (NaN too)
    return results[0].localization, job


def reference(toys: list[Toy], context, cfg: LocalizerConfig | None = None):
    whole = Toy(torch.cat([t.V for t in toys]) / len(toys))
    return Localizer(cfg or LocalizerConfig(), decode).localize(
        7, whole.view(), whole.stored(), whole.scope(), context).localization


def where(loc, job_scope: bool) -> set[tuple[int, int, int]]:
    return {((c.rank * M if job_scope else 0) + c.micro_batch, c.sample, c.position) for c in loc.culprits}


def test_a_culprit_on_rank_1_is_located_as_on_one_rank() -> None:
    toys = [planted({}), planted({(1, 0, 2): basis(D, 1, 100)})]
    loc, _ = run_job(toys, ctx())
    ref = reference(toys, ctx())
    assert (loc.status, loc.level, loc.probes) == (ref.status, ref.level, ref.probes) == ("located", "token", 1)
    assert where(loc, True) == where(ref, False) == {(M + 1, 0, 2)} and loc.culprits[0].rank == 1
    assert loc.explained_share == pytest.approx(ref.explained_share, rel=1e-12)
    assert loc.norm_without_culprits == pytest.approx(ref.norm_without_culprits, rel=1e-12)
    assert loc.spans[0].rank == 1 and loc.micro_batch_shares == ()


def test_the_candidate_set_grows_across_ranks() -> None:
    """The big culprit on rank 1 alone leaves a spike; the relaxed round takes rank 0's second tier."""
    toys = [planted({(0, 0, 0): basis(D, 2, 21), (0, 1, 3): basis(D, 2, 21)}),
            planted({(1, 0, 1): basis(D, 1, 100)})]
    loc, _ = run_job(toys, ctx(healthy=11.0 / 2, std=4.0 / 2))
    ref = reference(toys, ctx(healthy=11.0 / 2, std=4.0 / 2))
    assert (loc.status, loc.probes) == (ref.status, ref.probes) == ("located", 2)
    assert where(loc, True) == where(ref, False) == {(0, 0, 0), (0, 1, 3), (M + 1, 0, 1)}
    assert loc.explained_share == pytest.approx(ref.explained_share, rel=1e-12)
    assert loc.norm_without_culprits == pytest.approx(ref.norm_without_culprits, rel=1e-12)


def even(boost: bool = False) -> Toy:
    """Every token one basis vector (all scores equal); with ``boost``, sample 1 of micro-batch 2 is
    4·e_0 at each position: it carries most of ‖∇‖², and no token of it stands out."""
    V = torch.zeros(M, 2, 4, D, dtype=torch.float64)
    for b in range(2):
        for t in range(4):
            V[:, b, t, b * 4 + t] = 1.0
    if boost:
        V[2, 1] = basis(D, 0, 4)
    return Toy(V)


def test_a_sample_on_rank_1_is_named_at_the_sample_level() -> None:
    toys = [even(), even(boost=True)]
    loc, _ = run_job(toys, ctx())
    ref = reference(toys, ctx())
    assert (loc.status, loc.level, loc.culprits) == (ref.status, ref.level, ()) == ("located", "sample", ())
    assert loc.explained_share == pytest.approx(ref.explained_share, rel=1e-12)
    (span,) = loc.spans
    assert (span.rank, span.micro_batch, span.sample, span.start, span.end) == (1, 2, 1, 0, 4)
    assert loc.probes == ref.probes


def test_an_even_spike_over_both_ranks_is_diffuse_with_measured_samples() -> None:
    toys = [even(), even()]
    loc, _ = run_job(toys, ctx())
    ref = reference(toys, ctx())
    assert (loc.status, loc.level, loc.culprits, loc.spans) == ("diffuse", "", (), ()) and ref.status == "diffuse"
    assert loc.probes == ref.probes == 3
    measured = [s for s in loc.samples if s.share is not None]
    assert len(measured) == 3 and {s.rank for s in loc.samples} <= {0, 1}
    assert [s.share for s in measured] == pytest.approx([s.share for s in ref.samples if s.share is not None])
    assert "spread evenly over 12 samples" in loc.note


def test_non_finite_positions_on_rank_1_are_named_without_probes() -> None:
    toys = [planted({}), planted({})]
    bad = toys[1].view()
    bad.scores[toys[1].flat(2, 1, 3)] = float("nan")
    loc, _ = run_job(toys, ctx(), views=[toys[0].view(), bad])
    assert (loc.status, loc.probes) == ("located", 0)
    assert [(c.rank, c.micro_batch, c.sample, c.position) for c in loc.culprits] == [(1, 2, 1, 3)]
    assert loc.note.endswith("on the ranks where it appears")


def test_a_rank_without_a_probe_closure_gives_attribution_shares_only() -> None:
    toys = [planted({}), planted({(1, 0, 2): basis(D, 1, 100)})]
    loc, job = run_job(toys, ctx(), probes=(False, True))
    assert (loc.status, loc.probes, loc.explained_share) == ("unverified", 0, None)
    assert [(c.rank, c.micro_batch) for c in loc.culprits] == [(1, 1)]
    assert loc.note == "a rank gave no probe closure: shares are attribution scores"


def test_a_rank_without_statistics_makes_it_unavailable_on_every_rank() -> None:
    toys = [planted({}), planted({(1, 0, 2): basis(D, 1, 100)})]
    loc, job = run_job(toys, ctx(), views=[None, toys[1].view()])
    assert (loc.status, loc.probes) == ("unavailable", 0)
    assert loc.note == "a rank has no per-token statistics for this step"
    assert job.calls[0] == job.calls[1] == ["gradloc candidates"]  # one collective, then both stopped


def test_a_probe_raising_on_one_rank_fails_every_rank_together() -> None:
    toys = [planted({(0, 0, 1): basis(D, 2, 100)}), planted({(1, 0, 2): basis(D, 1, 100)})]

    def broken(i: int, mask: torch.Tensor) -> torch.Tensor:
        raise ValueError("the user's closure broke")

    with pytest.raises(ProbeFailed, match="the probe on rank 1 failed: ValueError: the user's closure broke"):
        run_job(toys, ctx(), closures=(None, broken))


def test_every_rank_issues_the_same_collectives_in_the_same_order() -> None:
    toys = [even(), even(boost=True)]
    _, job = run_job(toys, ctx())
    assert job.calls[0] == job.calls[1] and len(job.calls[0]) > 3


def test_the_decomposition_probe_runs_on_the_rank_that_holds_the_micro_batch() -> None:
    """A tiny GPT on 2 ranks (one model copy each, DDP's averaged gradient stored on both); rank 1's
    micro-batch 1 holds a sample of one repeated token, and no token stands out in the (flat)
    attribution scores. Rank 1 decomposes its micro-batch, rank 0 idles; both name the sample (it carries
    over half of the step's excess over the norm it would have had without it), with the share a
    brute-force probe of the sample gives (its gradient enters the job's ÷ 2)."""
    import numpy as np

    from gradloc.collector.batch import make_meta
    from gradloc.localizer.probes import dot
    from gradloc.localizer.token_view import TokenView
    from tests.helpers import make_data, tiny_gpt

    datas = [make_data(1, 2, seed=11), make_data(1, 2, seed=12)]
    datas[1].x[0, 1, 2, :] = 7
    datas[1].y[0, 1, 2, :] = 7
    models = [tiny_gpt(0), tiny_gpt(0)]
    local = []
    for model, data in zip(models, datas):
        for i in range(2):
            data.loss(model, 0, i).backward()
        local.append([p.grad.detach().clone() for p in model.parameters()])
    g = [(a + b) / 2 for a, b in zip(*local)]
    norm = float(torch.sqrt(sum((x.double() ** 2).sum() for x in g)))
    mask = torch.zeros(4, datas[1].x.shape[-1], dtype=torch.bool)
    mask[2] = True
    ref = tiny_gpt(0)
    datas[1].loss(ref, 0, 1, mask).backward()
    g_s = [p.grad / 2 for p in ref.parameters()]  # the sample's part of the job's gradient
    brute = dot(g_s, g) / norm ** 2
    healthy = float(torch.sqrt(sum(((a - b).double() ** 2).sum() for a, b in zip(g, g_s))))  # the step without it
    job = FakeJob(2)

    def rank(r: int):
        model, data = models[r], datas[r]
        params = list(model.parameters())
        for p, x in zip(params, g):
            p.grad = x.clone()
        metas = tuple(make_meta(i, data.y[0, i], None, None, None) for i in range(2))
        n = metas[0].n_tokens
        scores = np.ones(2 * n)
        if r == 1:
            scores[n:] = 1.01  # rank 1's micro-batch 1 holds the top-scoring sample, by a hair
        view = TokenView((), metas, (0, n, 2 * n), scores, None, np.ones(2 * n, dtype=bool), 0.0)
        scope = DDPScope(comm=job.comm(r), model=model, params=params, metas=metas, probe=data.probe(model, 0),
                         pause_hooks=lambda on: None, probe_context=contextlib.nullcontext,
                         grads=[p.grad for p in params], inv_scale=1.0, norm=norm)
        return Localizer(LocalizerConfig(), None).localize(
            7, view, StoredGradient([p.grad for p in params], 1.0, norm), scope, ctx(healthy=healthy), head=model.head,
            has_probe=True)

    results = job.run(rank)
    loc = results[0].localization
    assert repr(loc) == repr(results[1].localization)
    assert (loc.status, loc.level, loc.passes) == ("located", "sample", 2)
    (span,) = loc.spans
    assert (span.rank, span.micro_batch, span.sample) == (1, 1, 2)
    assert loc.explained_share == pytest.approx(brute, rel=1e-6)  # the re-measure probe: exact
    assert loc.samples[0].share == pytest.approx(brute, rel=1e-2)  # the decomposition: to first order


def coherent(a: float) -> Toy:
    """Every token of every sample a·e_0: a rank whose data went wrong as a whole (each sample alike,
    their gradients adding up), no token or sample standing out."""
    V = torch.zeros(M, 2, 4, D, dtype=torch.float64)
    V[..., 0] = a
    return Toy(V)


def test_a_rank_whose_every_sample_went_wrong_is_named_at_the_rank_level() -> None:
    """Rank 1's 6 samples each carry 1/6 of its share, under the sample floor (2.5/12 of ‖∇‖²); the rank
    carries ⟨∇_1/2, ∇⟩/‖∇‖² = 612/666 ≥ the rank floor (0.75 for W = 2): one probe of its 3 micro-batches,
    the passes after the first counted apart. One process over the same data never names a rank."""
    from gradloc.localizer.ranks import rank_floor

    toys = [even(), coherent(2.0)]
    loc, job = run_job(toys, ctx())
    g = (toys[0].grad_of() + toys[1].grad_of()) / 2
    brute = float((toys[1].grad_of() / 2) @ g / (g @ g))
    assert brute == pytest.approx(612 / 666)
    assert (loc.status, loc.level, loc.culprits, loc.spans) == ("located", "rank", (), ())
    (group,) = loc.groups
    assert (group.rank, group.micro_batch, group.micro_batches, group.samples, group.tokens) == (1, None, M, 6, 24)
    assert loc.explained_share == group.share == pytest.approx(brute, rel=1e-12) and brute >= rank_floor(2)
    assert loc.norm_without_culprits == pytest.approx(float((g - toys[1].grad_of() / 2).norm()), rel=1e-12)
    assert (loc.probes, loc.passes) == (2, M - 1)  # a sample of rank 1, then rank 1 as a whole
    assert [s.share for s in loc.samples if s.share is not None] == pytest.approx([brute / 6])
    assert "rank level" in loc.note
    assert job.calls[0] == job.calls[1]
    assert reference(toys, ctx()).level != "rank"


def test_a_rank_under_the_rank_floor_is_measured_and_not_named() -> None:
    """a = 0.4: rank 0 scores 24/(24 + 24·0.16) = 86% of the attribution score, above the rank floor
    (0.75 for W = 2), so after its top sample measures nothing it is measured as a whole: ⟨∇_0/2, ∇⟩ /
    ‖∇‖² under the floor — not named; the spike stays diffuse, the rank's share in the note."""
    toys = [even(), coherent(0.4)]
    loc, _ = run_job(toys, ctx())
    g = (toys[0].grad_of() + toys[1].grad_of()) / 2
    share0 = float((toys[0].grad_of() / 2) @ g / (g @ g))
    assert share0 < 0.75
    assert (loc.status, loc.level, loc.groups, loc.probes, loc.passes) == ("diffuse", "", (), 3, M - 1)
    assert f"rank 0's {M} micro-batch(es) measured together: {share0:.0%} of ‖∇‖²" in loc.note
