"""A small Megatron-core tensor-parallel job for the distributed tests: blocks built from ``ColumnParallelLinear``
/ ``RowParallelLinear`` on sequence-first activations ``[s, b, h]``, with ordinary torch modules (embedding,
LayerNorms, LM head) replicated over tp.

The three blocks use the parallel linears three ways: ``inside`` (biases added by the layers), ``caller``
(``skip_bias_add=True``: the caller adds the returned biases, as Megatron's bias-GELU / bias-dropout-add
fusions do), ``gathered`` (the column-parallel output all-gathered, ``gather_output=True``, and the
row-parallel layer scattering its whole input itself, ``input_is_parallel=False``). Attention projects q/k/v
with one column-parallel layer whose output features are laid out [head, (q, k, v), hd], so a tp rank's slice
holds whole heads. The torch LayerNorms run on a batch-first view: gradloc's torch-module rules place (B, T)
leads only (only the Megatron rule knows [s, b]).

Weights: ``use_cpu_initialization=True`` makes every rank draw the whole master weight from the CPU generator
(``torch.empty(out, in)`` then ``init_method``) and keep its partition (``_initialize_affine_weight_cpu``; biases
zeroed, no draw). The test's reference (``PlainToy`` in test_megatron.py: ``nn.Linear``s, batch-first, no
megatron) makes the same draws in the same order, so the same seed gives it exactly the unpartitioned weights
(checked on the gathered partitions, bitwise).

Sequence parallelism (``sp``): the config's ``sequence_parallel=True``; the embedding's output split by Megatron's
``scatter_to_sequence_parallel_region`` (as ``LanguageModelEmbedding`` does), the parallel linears gathering and
reduce-scattering the sequence themselves, the head Megatron's column-parallel output layer with its
``vocab_parallel_cross_entropy``, and the ``gathered`` block's row layer fed Megatron's own split of the gathered
activation (SP requires ``input_is_parallel=True``). The norms are torch LayerNorms on the batch-first view with
their parameters marked ``sequence_parallel`` — a stand-in: Megatron's own SP norms are apex's ``FusedLayerNorm``
or Transformer Engine's (neither is installed here; its torch fallback ``WrappedTorchNorm`` asserts
``not config.sequence_parallel``), and they mark their parameters the same way; their gradients are summed over tp
by Megatron's own ``_allreduce_non_tensor_model_parallel_grads`` (``sp_finalize``) before ``end_step``.

Data: every tp rank sees the same micro-batches. Micro-batch i's loss is Σ w·mask·ce / (B·T·M); ``plant`` =
(step, micro-batch, sample, position) multiplies one token's loss weight by 3000 there.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, B, M, D, HEADS, FF = 64, 12, 3, 2, 32, 4, 64  # B != SEQ: a transposed score would not fit
HD = D // HEADS
BLOCKS = ("inside", "caller", "gathered")


def megatron() -> Any:
    """The megatron-core modules used here (imported in the ranks only; ~6 s)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed", tp_group deprecations
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.model_parallel_config import ModelParallelConfig
    return parallel_state, tensor_parallel, ModelParallelConfig


def cpu_gather_shim() -> None:
    """Megatron-core 0.19.2's ``mappings._gather_along_last_dim`` allocates its receive buffer on
    ``torch.cuda.current_device()``, which fails without CUDA; it runs for ``gather_output=True`` (forward) and
    for ``input_is_parallel=False`` (the scatter's backward). This is the same function with the buffer on the
    input's device (the autograd functions look it up by module global, so replacing it is enough)."""
    from megatron.core.tensor_parallel import mappings

    def gather_along_last_dim(input_: torch.Tensor, group: Any) -> torch.Tensor:
        world_size = group.size()
        if world_size == 1:
            return input_
        shape = list(input_.size())
        shape[0] *= world_size
        output = torch.empty(shape, dtype=input_.dtype, device=input_.device)
        mappings.dist_all_gather_func(output, input_.contiguous(), group=group)
        return torch.cat(output.chunk(world_size, dim=0), dim=-1).contiguous()  # [w·s, b, h/w] -> [s, b, h]

    mappings._gather_along_last_dim = gather_along_last_dim


class Attention(nn.Module):
    def __init__(self, cfg: Any, tp_mod: Any, tp_group: Any) -> None:
        super().__init__()
        init = init_method()
        self.qkv = tp_mod.ColumnParallelLinear(D, 3 * D, config=cfg, init_method=init, bias=True,
                                               gather_output=False, tp_group=tp_group)
        self.proj = tp_mod.RowParallelLinear(D, D, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                                             skip_bias_add=False, tp_group=tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv(x)  # [s, b, 3·D/tp]
        s, b, width = qkv.shape
        heads = width // (3 * HD)
        q, k, v = qkv.view(s, b, heads, 3, HD).unbind(3)  # [s, b, 3·D/tp] -> 3 × [s, b, H/tp, hd]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [s, b, H/tp, hd] -> [b, H/tp, s, hd]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.permute(2, 0, 1, 3).reshape(s, b, heads * HD)  # [b, H/tp, s, hd] -> [s, b, D/tp]
        return self.proj(y)[0]


class MLP(nn.Module):
    def __init__(self, cfg: Any, tp_mod: Any, tp_group: Any, kind: str) -> None:
        super().__init__()
        init, skip = init_method(), kind == "caller"
        self.fc1 = tp_mod.ColumnParallelLinear(D, FF, config=cfg, init_method=init, bias=True, skip_bias_add=skip,
                                               gather_output=kind == "gathered", tp_group=tp_group)
        self.split = kind == "gathered" and cfg.sequence_parallel  # SP: the row layer's input must be parallel
        self.fc2 = tp_mod.RowParallelLinear(FF, D, config=cfg, init_method=init, bias=True,
                                            input_is_parallel=kind != "gathered" or self.split, skip_bias_add=skip,
                                            tp_group=tp_group)
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, b1 = self.fc1(x)  # [s, b, FF/tp] ([s, b, FF] gathered)
        h = F.gelu(h if b1 is None else h + b1)
        if self.split:  # Megatron's own split of the last dim: [s, b, FF] -> [s, b, FF/tp]
            from megatron.core.tensor_parallel import scatter_to_tensor_model_parallel_region

            h = scatter_to_tensor_model_parallel_region(h, group=self.tp_group)
        y, b2 = self.fc2(h)  # [s, b, D], whole after the all-reduce ([s/tp, b, D] reduce-scattered under SP)
        return y if b2 is None else y + b2


class Block(nn.Module):
    def __init__(self, cfg: Any, tp_mod: Any, tp_group: Any, kind: str) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = Attention(cfg, tp_mod, tp_group)
        self.mlp = MLP(cfg, tp_mod, tp_group, kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s, b, D]
        x = x + self.attn(_batch_first(self.norm1, x))
        return x + self.mlp(_batch_first(self.norm2, x))


def _batch_first(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return norm(x.transpose(0, 1)).transpose(0, 1)  # [s, b, D] -> (B, T, D) -> normed -> [s, b, D]


def init_method() -> Any:
    return lambda w: nn.init.normal_(w, std=0.08)


class MegatronToy(nn.Module):
    """``vocab_parallel``: the LM head is Megatron's own output layer, a ``ColumnParallelLinear`` whose logits stay
    split by vocabulary, ``[s, b, V/tp]`` (``gather_output=False``), for ``vocab_parallel_token_losses``;
    otherwise a torch ``nn.Linear`` replicated over tp, batch-first (B, T, V)."""

    def __init__(self, tp: int, seed: int = 0, vocab_parallel: bool = False, sp: bool = False) -> None:
        super().__init__()
        ps, tp_mod, Config = megatron()
        vocab_parallel = vocab_parallel or sp  # under SP the head gathers the sequence itself
        cfg = Config(tensor_model_parallel_size=tp, use_cpu_initialization=True, params_dtype=torch.float32,
                     sequence_parallel=sp)
        self.sp, self.group = sp, ps.get_tensor_model_parallel_group()
        group = ps.get_tensor_model_parallel_group()
        torch.manual_seed(seed)  # every rank (and PlainToy) draws the same master weights
        self.tok = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block(cfg, tp_mod, group, kind) for kind in BLOCKS)
        self.norm = nn.LayerNorm(D)
        self.vocab_parallel = vocab_parallel
        self.head = tp_mod.ColumnParallelLinear(D, VOCAB, config=cfg, init_method=init_method(), bias=False,
                                                gather_output=False, tp_group=group) if vocab_parallel else \
            nn.Linear(D, VOCAB, bias=False)
        if sp:  # the SP region's norms, marked as Megatron's SP norms mark theirs (finalize_model_grads reduces them)
            for m in self.modules():
                if isinstance(m, nn.LayerNorm):
                    for p in m.parameters():
                        p.sequence_parallel = True

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx).transpose(0, 1).contiguous()  # (B, T, D) -> [s, b, D], as Megatron's embedding does
        if self.sp:  # LanguageModelEmbedding's own split: [s, b, D] -> [s/tp, b, D]
            from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

            x = scatter_to_sequence_parallel_region(x, group=self.group)
        for layer in self.layers:
            x = layer(x)
        if self.vocab_parallel:
            return self.head(_batch_first(self.norm, x))[0]  # [s, b, D] -> [s, b, V/tp]
        return self.head(self.norm(x.transpose(0, 1)))  # [s, b, D] -> (B, T, D) -> (B, T, V)


def cpu_device_shim() -> None:
    """Megatron-core 0.19.2's sequence-parallel paths allocate their buffers on ``torch.cuda.current_device()``
    (``GlobalMemoryBuffer.get_tensor``: the column-parallel layer's all-gather of its input;
    ``LinearWithGradAccumulationAndAsyncCommunication.backward``: the reduce-scatter of its input gradient;
    ``_gather_along_first_dim`` / ``_reduce_scatter_along_first_dim``), which raises without CUDA. Here (a CPU-only
    torch, the ranks only) it names the CPU, so those buffers are where the tensors are; the collectives are gloo's
    own ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (both run on CPU in torch 2.13)."""
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: torch.device("cpu")


def setup(tp: int) -> Any:
    """Megatron's parallel state for tp (the default gloo group is the launcher's) and the CPU shims."""
    ps, _, _ = megatron()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    cpu_gather_shim()
    cpu_device_shim()
    return ps


def whole_params(model: nn.Module, ps: Any, grads: bool = False) -> dict[str, Any]:
    """Every parameter (or gradient) whole, as a numpy array: a partitioned one gathered over the tp group along
    its ``partition_dim`` (rank order), a replicated one as it is. numpy, not torch: once megatron.core is
    imported every pickled tensor names ``megatron.core.safe_globals`` (it replaces
    ``torch.storage._load_from_bytes``), so a tensor returned to the test would import megatron there."""
    import torch.distributed as dist

    group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    out = {}
    for n, p in model.named_parameters():
        t = (p.grad if grads else p).detach()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, dim=p.partition_dim)
        out[n] = t.numpy().copy()
    return out


def data(steps: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(VOCAB, (steps, M, B, SEQ + 1), generator=g)
    return tokens[..., :-1].clone(), tokens[..., 1:].clone(), torch.ones(steps, M, B, SEQ)


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    Bl, T, V = logits.shape
    return F.cross_entropy(logits.reshape(Bl * T, V), targets.reshape(Bl * T), reduction="none").view(Bl, T)


def vocab_parallel_token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Megatron's ``vocab_parallel_cross_entropy`` on this rank's vocabulary shard ``[s, b, V/tp]`` (a collective
    over the tp group) -> the whole (B, T) per-token cross entropy, on every tp rank."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits, targets.t().contiguous()).t()  # (B, T) -> [s, b] -> (B, T)


def module_norms(grads: dict[str, Any]) -> dict[str, float]:
    """Per-module gradient norms (the "module" layer grouping) from whole per-parameter gradients, float64."""
    sq: dict[str, float] = {}
    for name, g in grads.items():
        mod = name.rsplit(".", 1)[0]
        sq[mod] = sq.get(mod, 0.0) + float((g.astype("float64") ** 2).sum())
    return {k: v ** 0.5 for k, v in sq.items()}


def sp_finalize(model: nn.Module, ps: Any) -> Any:
    """Megatron's own reduction of the ``sequence_parallel`` parameters' gradients over tp
    (``finalize_model_grads``' ``_allreduce_non_tensor_model_parallel_grads``), as its schedules run it after the
    micro-batches' backward and before the optimizer step; the model chunk carries the default DDP config it reads."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=len(BLOCKS), hidden_size=D, num_attention_heads=HEADS, sequence_parallel=True,
                            tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                            use_cpu_initialization=True, params_dtype=torch.float32)
    model.ddp_config = DistributedDataParallelConfig()
    return lambda: _allreduce_non_tensor_model_parallel_grads([model], cfg, ps.get_tensor_model_parallel_group())


def train(rank: int, world: int, tp: int, steps: int, plant: tuple | None = None,
          monitor: bool = True, sp: bool = False) -> dict[str, Any]:
    """``steps`` AdamW steps: the reports' essentials, the whole initial parameters, the first step's whole
    per-module gradient norms (the partitions gathered), gradloc's collectives per step and this rank's final
    parameters (its partitions). ``sp``: sequence parallelism (the vocabulary-parallel head, Megatron's loss)."""
    import gradloc

    ps = setup(tp)
    model = MegatronToy(tp, sp=sp)
    out: dict[str, Any] = {"reports": [], "init": whole_params(model, ps)}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y, w = data(steps)
    if plant is not None:
        s, mb, b, t = plant
        w[s, mb, b, t] = 3000.0
    mon = gradloc.watch(model, opt, store=False, detector=gradloc.DetectorConfig(warmup=5)) if monitor else None
    from tests.distributed.loop import essentials, run_steps

    def norms() -> None:
        out["norms"] = module_norms(whole_params(model, ps, grads=True))

    reports, out["collectives"] = run_steps(model, opt, mon, (x, y, w), steps, after_first_backward=norms,
                                            token_losses=vocab_parallel_token_losses if sp else token_losses,
                                            finalize=sp_finalize(model, ps) if sp else None)
    out["reports"] = [essentials(r) for r in reports]
    out["head"] = [head_precursors(r) for r in reports]
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    if mon is not None:
        out["counters"] = {k: v for k, v in mon.counters.items() if k.startswith("precursors_")}
        mon.close()
    return out


def head_precursors(rep: Any) -> dict[str, tuple]:
    """A step's precursor values of the loss head and the final norm by kind: (value, (micro-batch, row,
    position))."""
    return {str(p.kind): (p.value, p.at) for p in rep.record.precursors
            if p.layer in ("head", "norm") and p.head is None}


def surprise(rank: int, world: int, tp: int, steps: int, vocab_parallel: bool, samples: Any,
             sp: bool = False) -> dict[str, Any]:
    """``steps`` AdamW steps with per-sample surprise judged (``samples``: a SampleConfig): which tp rank this is,
    how many samples it judged each step, and the judged samples' mean surprise in judging order."""
    import gradloc
    from tests.distributed.loop import run_steps

    ps = setup(tp)
    model = MegatronToy(tp, vocab_parallel=vocab_parallel, sp=sp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = gradloc.watch(model, opt, store=False, samples=samples)
    losses = vocab_parallel_token_losses if vocab_parallel or sp else token_losses
    reports, _ = run_steps(model, opt, mon, data(steps), steps, token_losses=losses,
                           finalize=sp_finalize(model, ps) if sp else None)
    judge = mon.samples.judge.mean
    out = {"tp_rank": rank % tp, "judged": [r.record.samples.judged if r.record.samples else None for r in reports],
           "surprise": [float(v) for v in judge.values[: judge.n]],
           "counters": {k: v for k, v in mon.counters.items() if v}}
    mon.close()
    return out


def bitwise(rank: int, world: int, tp: int, steps: int, plant: tuple, sp: bool = False) -> dict[str, Any]:
    """Train without gradloc, then with it (the same seed and data): the watched run's results, and whether
    this rank's parameters came out bitwise the same."""
    plain = train(rank, world, tp, steps, plant=plant, monitor=False, sp=sp)
    watched = train(rank, world, tp, steps, plant=plant, sp=sp)
    mine = watched.pop("params")  # tensors stay here (whole_params says why)
    return {**watched, "bitwise": all(torch.equal(plain["params"][n], mine[n]) for n in mine)}


__all__ = ["MegatronToy", "bitwise", "head_precursors", "init_method", "data", "module_norms", "surprise",
           "token_losses", "train", "vocab_parallel_token_losses", "B", "D", "M", "SEQ", "VOCAB"]
