"""Megatron-core's own ``GPTModel`` (the local layer spec: ``WrappedTorchNorm`` norms, ``DotProductAttention``
with its ``FusedScaleMaskSoftmax``, ``ColumnParallelLinear`` / ``RowParallelLinear`` projections, the
column-parallel output layer) under tensor parallelism on gloo ranks, watched by gradloc at its defaults, with the
precursor values each rank's own hooks say the model had: the final norm's input ``[s, b, h]``, the output
layer's logits ``[s, b, V/tp]`` gathered over the tp group, and each attention's scores from its query and key
``[s, b, heads/tp, hd]`` (Megatron's contract: sequence first; the test reads them independently of gradloc).

Stand-ins (Megatron's CUDA-only paths, on a CPU-only torch, ranks only): ``cpu_device_shim``
(megatron_job.py: ``GlobalMemoryBuffer`` and the gathers allocate on ``torch.cuda.current_device()``); the CUDA
RNG tracker's ``fork`` is a no-op context (it swaps CUDA generator states around the attention dropout, which is
0 here); the causal mask is passed (``get_default_causal_mask`` builds it on ``"cuda"``).
"""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any

import torch

VOCAB, SEQ, B, M, D, HEADS, LAYERS = 64, 12, 3, 2, 32, 4, 2  # B != SEQ: a transposed read would not fit


def _model(tp: int, qk_layernorm: bool = False) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed", GPTModel's deprecation
        from megatron.core import tensor_parallel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

        tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
        cfg = TransformerConfig(num_layers=LAYERS, hidden_size=D, num_attention_heads=HEADS,
                                tensor_model_parallel_size=tp, use_cpu_initialization=True,
                                attention_dropout=0.0, hidden_dropout=0.0, qk_layernorm=qk_layernorm)
        torch.manual_seed(0)  # every tp rank draws the same master weights (the norms are replicated)
        return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=qk_layernorm), vocab_size=VOCAB,
                        max_sequence_length=SEQ)


class Seen:
    """What the model computed, per micro-batch, read by the test's own hooks (registered before gradloc's)."""

    def __init__(self, model: Any, group: Any) -> None:
        self.group, self.mb = group, 0
        self.rms: list[torch.Tensor] = []  # per micro-batch (B, T): each position's RMS at the final norm
        self.logits: list[torch.Tensor] = []  # per micro-batch (B, T, V): the whole vocabulary
        self.scores: dict[str, list[torch.Tensor]] = {}  # site -> per micro-batch (B, heads/tp, T, T), −inf masked
        self.embedding: list[torch.Tensor] = []  # per micro-batch (B, T): ‖g_p‖² at the word embedding's output
        model.decoder.final_layernorm.register_forward_pre_hook(self._norm)
        model.embedding.word_embeddings.register_forward_hook(self._embedding)
        model.output_layer.register_forward_hook(self._head)
        for i, layer in enumerate(model.decoder.layers):
            site = f"decoder.layers.{i}.self_attention.core_attention.scale_mask_softmax"
            layer.self_attention.core_attention.register_forward_pre_hook(self._attention(site))

    def _norm(self, module: Any, args: tuple) -> None:
        x = args[0].detach().transpose(0, 1).float()  # [s, b, h] -> (B, T, h)
        self.rms.append(x.pow(2).mean(-1).sqrt())  # (B, T)

    def _embedding(self, module: Any, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(lambda g: self.embedding.append(g.detach().pow(2).sum(-1)))  # (B, T, h) -> (B, T)

    def _head(self, module: Any, args: tuple, out: Any) -> None:
        import torch.distributed as dist

        part = out[0].detach().transpose(0, 1).contiguous()  # [s, b, V/tp] -> (B, T, V/tp)
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, part, group=self.group)
        self.logits.append(torch.cat(parts, dim=-1))  # tp-ordered vocabulary shards -> (B, T, V)

    def _attention(self, site: str):
        def hook(module: Any, args: tuple) -> None:
            q, k = args[0].detach().float(), args[1].detach().float()  # [s, b, heads/tp, hd]
            s = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(q.shape[-1])  # (B, heads/tp, T, T)
            causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)  # key after query
            self.scores.setdefault(site, []).append(s.masked_fill(causal, float("-inf")))
        return hook


def expected(seen: Seen) -> dict[str, Any]:
    """A step's precursor values as the test reads them: the residual's mean RMS and its largest (micro-batch, row,
    position); the head's max |logit| and where; per attention site this rank's heads' largest logit and each
    head's mean row entropy (attention is measured in the first micro-batch: gradloc's default)."""
    out: dict[str, Any] = {}
    rms = torch.stack(seen.rms)  # (M, B, T)
    at = torch.unravel_index(rms.argmax(), rms.shape)
    out["residual_rms"] = (float(rms.mean()), tuple(int(i) for i in at), float(rms.max()))
    top = torch.stack(seen.logits).abs().amax(-1)  # (M, B, T, V) -> (M, B, T)
    at = torch.unravel_index(top.argmax(), top.shape)
    out["logit_max_abs"] = (float(top.max()), tuple(int(i) for i in at))
    out["embedding"] = torch.stack(seen.embedding).tolist()  # (M, B, T): every position's id is one rank's row
    for site, calls in seen.scores.items():
        s = calls[0]  # (B, h, T, T): the first micro-batch
        p = torch.softmax(s, dim=-1)
        ent = torch.special.entr(p).sum(-1)  # (B, h, T)
        out[site] = {"max": float(s.amax()), "entropy": ent.mean((0, 2)).tolist()}  # per head: its rows' mean
    return out


def train(rank: int, world: int, tp: int, steps: int, plant: tuple[int, int, int, int],
          qk_layernorm: bool = False) -> dict[str, Any]:
    """``steps`` AdamW steps of the GPTModel on random tokens, ``M`` micro-batches of (B, SEQ) each, one token's loss
    × 3000 at ``plant`` = (step, micro-batch, sample, position); per step the precursor values gradloc reported
    (kind, layer, head, value, at) and :func:`expected`'s, the top tokens (micro-batch, sample, position, score, the
    word embedding's part of it), the unattributed share and the incident's localization (status, probes,
    culprits); gradloc's precursor counters. (The probes run the model again: the plant step's expectations are
    not the step's.) ``qk_layernorm``: Megatron's q/k layernorm in every attention (``[s, b, heads, d]``)."""
    import torch.nn.functional as F  # noqa: F401  (the loss is Megatron's own: labels given)

    import gradloc
    from tests.distributed.megatron_job import setup

    ps = setup(tp)
    model = _model(tp, qk_layernorm)
    seen = Seen(model, ps.get_tensor_model_parallel_group())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = gradloc.watch(model, opt, store=False, detector=gradloc.DetectorConfig(warmup=5))
    g = torch.Generator().manual_seed(7)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]  # True: masked (Megatron's convention)
    pos = torch.arange(SEQ).expand(B, SEQ)
    out: dict[str, Any] = {"steps": []}
    for step in range(steps):
        seen.rms, seen.logits, seen.scores, seen.embedding = [], [], {}, []
        batch = [torch.randint(VOCAB, (B, SEQ + 1), generator=g) for _ in range(M)]
        weight = torch.ones(M, B, SEQ)
        if step == plant[0]:
            weight[plant[1:]] = 3000.0

        def loss_for(i: int, keep: torch.Tensor | None = None) -> torch.Tensor:
            ids = batch[i]
            losses = model(ids[:, :-1], pos, mask, labels=ids[:, 1:]) * weight[i]  # (B, T): Megatron's own CE
            return (losses if keep is None else losses * keep).sum() / (B * SEQ * M)

        total = torch.zeros(())
        for i in range(M):
            with mon.micro_batch(batch[i][:, 1:]):
                loss = loss_for(i)
                loss.backward()
            total += loss.detach()
        rep = mon.end_step(total, probe=loss_for)
        loc = rep.incident.localization if rep.incident is not None else None
        got = [(str(p.kind), p.layer, p.head, p.value, p.at) for p in rep.record.precursors]
        tok = rep.record.tokens
        top = [(t.micro_batch, t.sample, t.position, t.score,
                sum(ls.share for ls in t.layers if ls.layer == "embedding.word_embeddings") * t.score) for t in tok.top]
        out["steps"].append({"got": got, "want": expected(seen), "top": top, "unattributed": tok.unattributed_share,
                             "dropped": tok.dropped_calls, "loc": None if loc is None else (
                                 str(loc.status), loc.probes, [(c.rank, c.micro_batch, c.sample, c.position)
                                                               for c in loc.culprits])})
        opt.step()
        opt.zero_grad()
    out["counters"] = {k: v for k, v in mon.counters.items() if k.startswith("precursors_") and v}
    mon.close()
    return out


__all__ = ["B", "HEADS", "LAYERS", "M", "SEQ", "VOCAB", "train"]
