"""Per-group data counts (collector/groups.py): each step's samples and loss tokens per source, tag and length
bucket, checked against a brute-force count over the same micro-batches, in one host transfer."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import gradloc
from gradloc.collector import groups as groups_mod
from gradloc.demo.model import GPTConfig, TinyGPT, token_losses
from gradloc.records import GroupKind, SampleInfo
from gradloc.records.groups import MAX_GROUPS, length_bucket
from tests.collector.test_host_transfers import count_syncs

VOCAB, T = 64, 16
NEVER = dict(z_threshold=1e9, layer_z_threshold=1e9, loss_z_threshold=1e9, token_z_threshold=1e9)


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyGPT(GPTConfig(vocab=VOCAB, seq=T, d_model=32, n_layers=1))
    opt = torch.optim.SGD(model.parameters(), 1e-3)
    return model, opt, gradloc.watch(model, opt, detector=gradloc.DetectorConfig(warmup=3, **NEVER))


def _infos(n: int, g: torch.Generator) -> list[SampleInfo]:
    out = []
    for _ in range(n):
        src = ("web", "code", None)[int(torch.randint(3, (1,), generator=g))]
        tags = {"lang": "en"} if torch.rand(1, generator=g) < 0.5 else {}
        out.append(SampleInfo(source=src, tags=tags))
    return out


def _brute(batches) -> Counter:
    """(kind, name) -> [samples, tokens] by hand: every sample's loss tokens counted from its own mask slice."""
    want: Counter = Counter()
    for infos, mask, cu in batches:
        rows = [mask[0, a:b] for a, b in zip(cu, cu[1:])] if cu else list(mask)
        for info, row in zip(infos, rows):
            n = int(row.sum())
            keys = [("source", info.source or "(none)"), ("length", length_bucket(n))]
            keys += [("tag", f"{k}={v}") for k, v in info.tags]
            for key in keys:
                want[key + ("samples",)] += 1
                want[key + ("tokens",)] += n
    return want


def _got(record) -> Counter:
    got: Counter = Counter()
    for grp in record.groups:
        got[(str(grp.kind), grp.name, "samples")] += grp.samples
        got[(str(grp.kind), grp.name, "tokens")] += grp.tokens
    return got


def test_counts_per_source_tag_and_length_match_a_brute_force_count_in_one_transfer(monkeypatch):
    model, opt, mon = _setup()
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        batches, loss = [], torch.zeros(())
        for packed in (False, True):
            x = torch.randint(VOCAB, (1 if packed else 4, T + 1), generator=g)
            mask = torch.rand(x.shape[0], T, generator=g) < 0.7
            cu = [0, 5, 11, T] if packed else None
            infos = _infos(3 if packed else 4, g)
            with mon.micro_batch(x[:, 1:], loss_mask=mask, sample_infos=infos, cu_seqlens=cu):
                part = (token_losses(model(x[:, :-1]), x[:, 1:]) * mask).sum() / mask.sum()
                part.backward()
            loss += part.detach()
            batches.append((infos, mask, cu))
        with count_syncs(monkeypatch) as syncs:
            report = mon.end_step(loss)
        opt.step()
        opt.zero_grad()
        assert syncs == {"cpu": 1, "numpy": 1}, syncs  # the counts ride the step's one host transfer
        assert _got(report.record) == _brute(batches)
        assert {grp.kind for grp in report.record.groups} >= {GroupKind.SOURCE, GroupKind.LENGTH}
    mon.close()


def test_no_provenance_no_groups_and_no_cost():
    model, opt, mon = _setup()
    x = torch.randint(VOCAB, (2, T + 1))
    with mon.micro_batch(x[:, 1:], sample_infos=[SampleInfo(request_id="r1"), SampleInfo(request_id="r2")]):
        token_losses(model(x[:, :-1]), x[:, 1:]).mean().backward()
    report = mon.end_step()
    assert report.record.groups == ()
    assert groups_mod.tokens_pack([], torch.device("cpu")) is None
    mon.close()


def test_without_a_loss_mask_every_position_counts():
    model, opt, mon = _setup()
    x = torch.randint(VOCAB, (1, T + 1))
    with mon.micro_batch(x[:, 1:], sample_infos=[SampleInfo(source="a"), SampleInfo(source="b")], cu_seqlens=[0, 6, T]):
        token_losses(model(x[:, :-1]), x[:, 1:]).mean().backward()
    got = {(str(grp.kind), grp.name): (grp.samples, grp.tokens) for grp in mon.end_step().record.groups}
    assert got[("source", "a")] == (1, 6) and got[("source", "b")] == (1, T - 6)
    mon.close()


def test_groups_past_the_bound_are_dropped_and_counted():
    model, opt, mon = _setup()
    n = MAX_GROUPS + 5  # one source per sample: more groups than a step may carry
    x = torch.randint(VOCAB, (n, T + 1))
    with mon.micro_batch(x[:, 1:], sample_infos=[SampleInfo(source=f"s{i}") for i in range(n)]):
        token_losses(model(x[:, :-1]), x[:, 1:]).mean().backward()
    record = mon.end_step().record
    assert len(record.groups) == MAX_GROUPS
    assert mon.counters["groups_dropped"] > 0
    mon.close()


def test_a_failing_count_is_counted_and_the_step_goes_on(monkeypatch):
    model, opt, mon = _setup()

    def boom(*a, **k):
        raise RuntimeError("planted")

    monkeypatch.setattr(groups_mod, "count_groups", boom)
    x = torch.randint(VOCAB, (2, T + 1))
    with mon.micro_batch(x[:, 1:], sample_infos=[SampleInfo(source="a"), SampleInfo(source="b")]):
        token_losses(model(x[:, :-1]), x[:, 1:]).mean().backward()
    report = mon.end_step()
    assert report.record.groups == () and mon.counters["group_errors"] == 1
    mon.close()


@pytest.mark.parametrize("bad", [dict(name="", samples=1, tokens=1), dict(name="a", samples=-1, tokens=1),
                                 dict(name="x" * 200, samples=1, tokens=1), dict(name="a", samples=1, tokens=True)])
def test_a_bad_group_is_refused(bad):
    with pytest.raises(ValueError, match="GroupTokens"):
        gradloc.records.GroupTokens(kind="source", **bad)
