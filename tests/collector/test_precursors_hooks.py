"""Precursor statistics through the hooks (collector/precursors/hooks.py) on real Hugging Face models: found by
themselves, the same from an eager attention's weights as from sampled SDPA rows (every row sampled), equal to what
the test computes from the model's own outputs, and never changing the numbers."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

import gradloc
from gradloc.config import PrecursorConfig, WatchConfig
from gradloc.records import PrecursorKind as K

pytest.importorskip("transformers")
from tests.collector.rules.hf_zoo import build  # noqa: E402

B, T = 2, 24


def _batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (B, T), generator=g) for _ in range(n)]


def _train(model, steps: int, cfg: PrecursorConfig | None, watch: bool = True, spy=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = gradloc.watch(model, opt, config=WatchConfig(job="pre", embedded=False, precursors=cfg or PrecursorConfig(),
                                                       token_stats=False)) if watch else None
    records = []
    data = _batches(steps * 2)
    for s in range(steps):
        for m in range(2):
            ids = data[2 * s + m]
            ctx = mon.micro_batch(shape=(B, T)) if mon else torch.enable_grad()
            with ctx:
                logits = model(ids).logits
                if spy is not None:
                    spy(s, m, logits.detach())
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
                loss.backward()
        if mon:
            records.append(mon.end_step(loss).record)
        opt.step()
        opt.zero_grad()
    if mon:
        mon.close()
    return records, (dict(mon.counters) if mon else {})


def _by_key(record) -> dict:
    return {(p.kind, p.layer, p.head): p for p in record.precursors}


@pytest.mark.parametrize("family", ["gpt2", "qwen3", "mixtral", "qwen3moe"])
def test_eager_weights_and_sampled_sdpa_rows_agree_and_every_layer_is_found(family: str) -> None:
    got = {}
    for impl in ("eager", "sdpa"):
        model = build(family)
        model.set_attn_implementation(impl)
        records, counters = _train(model, 2, PrecursorConfig(attention_queries=T, per_head=True))
        assert not {k for k in counters if k.startswith("precursors")}, counters
        got[impl] = records
    n_layers = 2
    for eager, sdpa in zip(got["eager"], got["sdpa"]):
        e, s = _by_key(eager), _by_key(sdpa)
        attn = {k for k in e if k[0] in (K.ATTN_MAX_LOGIT, K.ATTN_ENTROPY)}
        assert len({k[1] for k in attn}) == n_layers and {k[2] for k in attn} == {None, 0, 1, 2, 3}
        # the same modules, the same values (float32 vs the eager path's own mask and dtype)
        assert {k for k in s if k[0] in (K.ATTN_MAX_LOGIT, K.ATTN_ENTROPY)} == attn
        for k in attn:
            assert e[k].value == pytest.approx(s[k].value, rel=2e-3, abs=2e-3), k
        for kind in (K.LOGIT_MAX_ABS, K.LOGIT_LSE_SQ, K.RESIDUAL_RMS):
            assert sum(1 for k in e if k[0] == kind) == 1, kind


def test_head_logits_are_the_model_s_own_and_routers_count_every_choice() -> None:
    seen = defaultdict(list)  # step -> the logits of each micro-batch
    calls = defaultdict(list)  # router name -> (counts, entropy sum, tokens) of each forward, in order
    model = build("qwen3moe")

    def router_hook(name):
        def hook(module, args, out):
            if torch.is_grad_enabled():
                p = torch.softmax(out[0].double(), -1)
                calls[name].append((torch.bincount(out[2].flatten(), minlength=4).double(),
                                    float(-(p * p.clamp_min(1e-300).log()).sum()), out[0].shape[0]))
        return hook

    for name, m in model.named_modules():
        if type(m).__name__.endswith("Router"):
            m.register_forward_hook(router_hook(name))
    records, _ = _train(model, 3, PrecursorConfig(), spy=lambda step, mb, logits: seen[step].append(logits))
    assert len(calls) == 2
    for step, record in enumerate(records):
        p = _by_key(record)
        # the first micro-batch of the run finds the head (discovery): its logits are measured from the next one on
        mine = seen[step][1:] if step == 0 else seen[step]
        want = max(float(x.abs().max()) for x in mine)
        (head,) = [v for k, v in p.items() if k[0] == K.LOGIT_MAX_ABS]
        assert head.value == pytest.approx(want, rel=1e-6) and head.layer == "lm_head"
        mb, row, pos = head.at
        assert float(seen[step][mb][row, pos].abs().max()) == pytest.approx(want, rel=1e-6)
        lse = torch.cat([torch.logsumexp(x.double(), -1).flatten() for x in mine])
        (z,) = [v for k, v in p.items() if k[0] == K.LOGIT_LSE_SQ]
        assert z.value == pytest.approx(float(lse.square().mean()), rel=1e-5)
        for name, per_call in calls.items():
            counts = sum(c for c, _, _ in per_call[2 * step:2 * step + 2])  # both micro-batches of the step
            ent = sum(e for _, e, _ in per_call[2 * step:2 * step + 2])
            tokens = sum(n for _, _, n in per_call[2 * step:2 * step + 2])
            assert counts.sum() == 2 * tokens == 2 * 2 * B * T  # top-2 of every token
            assert p[(K.EXPERT_LOAD_MAX, name, None)].value == pytest.approx(float(counts.max() / counts.mean()))
            assert p[(K.DEAD_EXPERTS, name, None)].value == float((counts == 0).sum())
            assert p[(K.ROUTER_ENTROPY, name, None)].value == pytest.approx(ent / tokens, rel=1e-5)


def test_the_numbers_are_bitwise_the_same_with_and_without_precursors() -> None:
    finals = []
    for watch, cfg in ((False, None), (True, PrecursorConfig(enabled=False)), (True, PrecursorConfig(per_head=True))):
        model = build("qwen3")
        model.set_attn_implementation("sdpa")
        _train(model, 3, cfg, watch=watch)
        finals.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(finals[0], finals[1]) and torch.equal(finals[0], finals[2])


def test_attention_every_n_steps_and_nothing_outside_a_block() -> None:
    model = build("qwen3")
    records, _ = _train(model, 4, PrecursorConfig(attention_every=2))
    has_attn = [any(p.kind == K.ATTN_MAX_LOGIT for p in r.precursors) for r in records]
    assert has_attn == [True, False, True, False]
    assert all(any(p.kind == K.LOGIT_MAX_ABS for p in r.precursors) for r in records[1:])
    mon = gradloc.watch(model, None, config=WatchConfig(job="pre2", embedded=False, token_stats=False))
    with torch.no_grad():
        model(_batches(1)[0])  # evaluation, outside any block: nothing measured, nothing counted
    assert not mon.precursors.slots and not {k for k in mon.counters if k.startswith("precursors")}
    mon.close()


@pytest.mark.parametrize("family", ["qwen3moe", "gpt2"])
def test_the_hooks_read_nothing_back_to_the_host(monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """The step's values ride its one transfer: forward and backward with the precursors make exactly the host reads
    they make without them (none of .item/.cpu/.tolist/bool(tensor)... in a hook: on a GPU each would be a sync).
    From the second micro-batch: in the first, discovery's mode dispatches every call, the counting wrapper's too,
    and counts the model's own reads twice (the same measuring code runs in both)."""
    from tests.collector.test_host_transfers import count_syncs

    seen = []
    for cfg in (PrecursorConfig(enabled=False), PrecursorConfig(per_head=True)):
        model = build(family)
        model.set_attn_implementation("sdpa" if family == "qwen3moe" else "eager")
        mon = gradloc.watch(model, None, config=WatchConfig(job="syncs", embedded=False, token_stats=False,
                                                           precursors=cfg))
        counts = []
        for ids in _batches(3):
            with count_syncs(monkeypatch) as c:
                with mon.micro_batch(shape=(B, T)):
                    model(ids).logits.float().logsumexp(-1).mean().backward()
            counts.append(dict(c))
        measured = len(mon.end_step().record.precursors)
        seen.append((counts[1:], measured))
        mon.close()
    assert seen[0][0] == seen[1][0]
    assert seen[0][1] == 0 and seen[1][1] >= 4  # measured: attention of both layers, the head, the final norm


class _BoundSdpa(torch.nn.Module):
    """An attention that bound SDPA when it was built (as code that imports the function by name does)."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.qkv, self.out, self.heads = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d), heads
        self.sdpa = torch.nn.functional.scaled_dot_product_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)  # (3, B, H, T, d)
        return self.out(self.sdpa(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.attn = torch.nn.Embedding(32, 16), _BoundSdpa()
        self.norm, self.head = torch.nn.LayerNorm(16), torch.nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        return self.head(self.norm(x + self.attn(x)))


def test_sdpa_sites_are_measured_through_the_swap_and_a_bound_function_falls_back_to_the_mode() -> None:
    model = build("qwen3")
    model.set_attn_implementation("sdpa")
    records, counters = _train(model, 2, PrecursorConfig(attention_queries=T))
    assert "precursors_swap_missed" not in counters
    assert torch.nn.functional.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # restored

    tiny = _Tiny()
    mon = gradloc.watch(tiny, None, config=WatchConfig(job="bound", embedded=False, token_stats=False))
    got = []
    for s in range(3):
        ids = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(s))
        with mon.micro_batch(shape=(2, 12)):
            tiny(ids).logsumexp(-1).mean().backward()
        got.append({p.kind for p in mon.end_step().record.precursors if p.layer == "attn"})
    assert mon.counters["precursors_swap_missed"] == 1  # step 1: the swap saw nothing; the mode from then on
    assert got[0] == got[2] == {K.ATTN_MAX_LOGIT, K.ATTN_ENTROPY}
    mon.close()


@pytest.mark.parametrize("micro_batches", [1, 0])
def test_attention_is_measured_in_the_first_micro_batches_of_a_step(micro_batches: int) -> None:
    """Per head, the entropy is the mean row entropy of the measured micro-batches' own attention weights (the
    model's, eager): the first only by default, every one with ``attention_micro_batches=0``."""
    model = build("qwen3")
    model.set_attn_implementation("eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = PrecursorConfig(per_head=True, attention_micro_batches=micro_batches)
    mon = gradloc.watch(model, opt, config=WatchConfig(job="mb", embedded=False, precursors=cfg, token_stats=False))
    data = _batches(6, seed=3)
    for s in range(3):
        weights = []
        for m in range(2):
            ids = data[2 * s + m]
            with mon.micro_batch(shape=(B, T)):
                out = model(ids, output_attentions=True)
                weights.append([a.detach().double() for a in out.attentions])  # per layer (B, H, T, T)
                loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
                loss.backward()
        rec = _by_key(mon.end_step(loss).record)
        opt.step()
        opt.zero_grad()
        measured = weights[:1] if micro_batches == 1 else weights
        for layer in range(2):
            site = f"model.layers.{layer}.self_attn"
            p = torch.cat([w[layer] for w in measured])  # (M·B, H, T, T)
            ent = -(p * p.clamp_min(1e-300).log()).sum(-1).mean(dim=(0, 2))  # (M·B, H, T) -> (H,)
            for h in range(ent.numel()):
                assert rec[(K.ATTN_ENTROPY, site, h)].value == pytest.approx(float(ent[h]), rel=1e-4, abs=1e-5)
            assert rec[(K.ATTN_MAX_LOGIT, site, None)].at[0] in ((0,) if micro_batches == 1 else (0, 1))
    mon.close()
