"""The model-parallel demo: ``--backend tp | fsdp-tp | pp`` on an even ``--world-size`` ≥ 4 (gloo, CPU).

- ``tp``: a (dp, tp 2) mesh, the model under DTensor tensor + sequence parallelism (torch's
  ``parallelize_module`` styles, torchtitan's plan) and replicated over dp by torch's composable
  ``replicate`` (DDP on FSDP2's machinery: the DDP that composes with DTensor TP);
- ``fsdp-tp``: the same TP, sharded over dp by FSDP2 (``fully_shard``): 2D;
- ``pp``: two pipeline stages (the embedding and the first half of the blocks; the rest, the norm and the
  head) × dp, each stage's module under FSDP2 over its data group, micro-batches through a GPipe schedule.

Each data rank trains on its own text; the culprit goes on data rank 1 (a non-zero data rank: the incident
must name it): a corrupted label — one position's target replaced by a random id, which a model that learned
the text finds very unlikely — weighted by ``advantage`` (RL-style) under ``--inject advantage``, the default. (The core demo picks the least likely token with a forward pass; a pipeline
stage cannot run one alone.) The model is :class:`ParallelGPT`: a Llama-shaped small LM written the way TP needs (the heads
come from the local width, separate q/k/v). gradloc watches the job as one; rank 0 emits the incident.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from gradloc.demo.data import provenance

PARALLEL_BACKENDS = ("tp", "fsdp-tp", "pp")
PLANT_DP_RANK = 1


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.d = heads, d
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.wq, self.wk, self.wv = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.wo = nn.Linear(d, d, bias=False)
        self.w1, self.w2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        q, k, v = self.wq(h), self.wk(h), self.wv(h)  # (B, T, D/tp) each under TP
        B, T, width = q.shape
        hd = self.d // self.heads
        q, k, v = (t.view(B, T, width // hd, hd).transpose(1, 2) for t in (q, k, v))  # (B, H/tp, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, width)  # (B, H/tp, T, hd) -> (B, T, D/tp)
        x = x + self.wo(y)
        return x + self.w2(F.silu(self.w1(self.norm2(x))))


class ParallelGPT(nn.Module):
    def __init__(self, vocab: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))  # (B, T, V)


def tp_plan(sp: bool) -> tuple[dict, dict]:
    """(top-level plan, per-block plan) of torch's TP styles; ``sp``: sequence-sharded activations (torchtitan's)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    seq = Shard(1) if sp else Replicate()
    top = {"tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
           "head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
    block = {n: ColwiseParallel(input_layouts=seq) for n in ("wq", "wk", "wv", "w1")}  # gathered under SP
    block.update(wo=RowwiseParallel(output_layouts=seq), w2=RowwiseParallel(output_layouts=seq))
    if sp:
        top["norm"] = SequenceParallel()
        block.update(norm1=SequenceParallel(), norm2=SequenceParallel())
    return top, block


def tensor_parallel(model: ParallelGPT, world: int, data: str | None, sp: bool = True, tp: int = 2) -> nn.Module:
    """``model`` under TP over a (dp, tp) mesh (tp alone when world == tp), the data dim ``data``: "replicate",
    "fsdp" or None."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    dp = world // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp")) if dp > 1 else \
        init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    top, block = tp_plan(sp)
    parallelize_module(model, mesh["tp"], top)
    for layer in model.layers:
        parallelize_module(layer, mesh["tp"], block)
    if dp > 1 and data == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif dp > 1 and data == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(model, mesh=mesh["dp"])
    return model


class Half(nn.Module):
    """One pipeline stage of a ParallelGPT: the embedding and the first half of the blocks, or the rest with the
    norm and the head."""

    def __init__(self, model: ParallelGPT, first: bool) -> None:
        super().__init__()
        self.first = first
        n = len(model.layers) // 2
        if first:
            self.tok, self.layers = model.tok, nn.ModuleList(model.layers[:n])
        else:
            self.layers, self.norm, self.head = nn.ModuleList(model.layers[n:]), model.norm, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) if self.first else x
        for layer in self.layers:
            h = layer(h)
        return h if self.first else self.head(self.norm(h))


def pipeline_stage(model: ParallelGPT, rank: int, world: int) -> tuple[Any, nn.Module, Any]:
    """(this rank's PipelineStage, its module, the (pp 2, dp) DeviceMesh): 2 stages × dp = world / 2, pp-major ranks (0..dp-1: stage 0), each
    stage's module under FSDP2 over its data group (not DDP: under pipelining DDP runs only with
    ``static_graph=True``, and then its gradient is not the data ranks' mean — measured here; PyTorch's
    pipelining integrates FSDP2, as torchtitan does)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage

    dp = world // 2
    mesh = init_device_mesh("cpu", (2, dp), mesh_dim_names=("pp", "dp"))
    part: nn.Module = Half(model, rank // dp == 0)
    if dp > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(part, mesh=mesh["dp"])
    return PipelineStage(part, rank // dp, 2, torch.device("cpu"), group=mesh["pp"].get_group()), part, mesh


def data_rank(backend: str, rank: int, world: int) -> int:
    """The data-parallel rank of global ``rank`` (tp is the inner dim; pipeline stages the outer one)."""
    return rank % (world // 2) if backend == "pp" else rank // 2


class TokenLoss:
    """(logits (B, T, V), target (B, T, 2): ids and per-token weights) -> (B, T) terms w · ce / n."""

    def __init__(self, n_tokens: int) -> None:
        self.n = n_tokens

    def __call__(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ids, w = target[..., 0].long(), target[..., 1].float()
        B, T, V = out.shape
        ce = F.cross_entropy(out.reshape(B * T, V).float(), ids.reshape(B * T), reduction="none").view(B, T)
        return ce * w / self.n


def run_rank(cfg: Any, vocab: int, on_step: Callable[[int, Any], None] | None, batches: Callable[..., list],
             watch: Callable[..., Any]) -> tuple[Any, list]:
    """One rank's training loop (gradloc/demo/run.py's, for the model-parallel backends); returns (the monitor,
    closed; planted culprits as (micro-batch, sample, position, token id, data rank)). ``batches(gen)``: the
    step's micro-batches [(x, y, each sample's window start)] of this data rank."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank = data_rank(cfg.backend, rank, world)
    gen = torch.Generator().manual_seed(cfg.seed + 1000 * dp_rank)  # the tp/pp ranks of a data index: same text
    model = ParallelGPT(vocab, cfg.d_model, cfg.n_layers, seed=cfg.seed)
    pp = cfg.backend == "pp"
    if pp:
        stage, part, _ = pipeline_stage(model, rank, world)
        target_model: Any = stage
    else:
        part = target_model = tensor_parallel(model, world, "replicate" if cfg.backend == "tp" else "fsdp")
    opt = torch.optim.AdamW(part.parameters(), lr=cfg.lr)
    mon = watch(target_model, opt)
    n_tokens = cfg.micro_batches * cfg.batch * (cfg.seq - cfg.prompt)
    mask = torch.ones(cfg.batch, cfg.seq, dtype=torch.bool)
    mask[:, :cfg.prompt] = False
    planted = []
    token_loss = TokenLoss(n_tokens)
    schedule = None
    if pp:
        from torch.distributed.pipelining import ScheduleGPipe

        schedule = ScheduleGPipe(stage, cfg.micro_batches, loss_fn=lambda o, t: token_loss(o, t).sum(),
                                 scale_grads=False)
    with mon:
        for step in range(cfg.steps):
            windows = batches(gen)
            mbs, infos = [(x, y) for x, y, _ in windows], [provenance(starts) for _, _, starts in windows]
            w = mask.float().expand(cfg.micro_batches, -1, -1).clone()  # (M, B, T) per-token weights
            if step == cfg.inject_step and cfg.inject != "none" and dp_rank == PLANT_DP_RANK:
                i, b = int(torch.randint(0, cfg.micro_batches, (1,), generator=gen)), \
                    int(torch.randint(0, cfg.batch, (1,), generator=gen))
                t = int(torch.randint(max(cfg.prompt, cfg.seq // 4), cfg.seq, (1,), generator=gen))
                x, y = mbs[i]
                y = y.clone()  # labels are a view of the inputs' window: corrupt the target only
                y[b, t] = int(torch.randint(0, vocab, (1,), generator=gen))  # a corrupted label: a random id
                mbs[i] = (x, y)
                if cfg.inject == "advantage":  # RL-style: the unlikely token also gets a large advantage (weight)
                    w[i, b, t] = cfg.advantage
                if rank == min(r for r in range(world) if data_rank(cfg.backend, r, world) == dp_rank):
                    planted.append((i, b, t, int(y[b, t]), dp_rank))  # said once per data rank
            if pp:
                x = torch.cat([m[0] for m in mbs])  # M × (B, T) -> (M·B, T): the schedule splits it back
                y = torch.cat([m[1] for m in mbs])
                target = torch.stack([y.double(), w.reshape(-1, cfg.seq).double()], -1)  # (M·B, T, 2)
                losses = mon.pipeline_step(schedule, inputs=x, target=target, token_ids=y,
                                           loss_mask=mask.repeat(cfg.micro_batches, 1), token_loss=token_loss,
                                           sample_infos=[info for part in infos for info in part])
                rep = mon.end_step(torch.stack(losses).sum() if losses else None)
            else:
                def loss_for(i: int, m: torch.Tensor | None = None, mbs: list = mbs, w: torch.Tensor = w) -> torch.Tensor:
                    x, y = mbs[i]
                    terms = token_loss(part(x), torch.stack([y.double(), w[i].double()], -1))
                    return (terms if m is None else terms * m).sum()

                total = torch.zeros(())
                for i, (_, y) in enumerate(mbs):
                    with mon.micro_batch(y, loss_mask=mask, sample_ids=[f"r{dp_rank}-s{step}-{i}-{b}"
                                                                        for b in range(cfg.batch)],
                                         sample_infos=infos[i]):
                        loss = loss_for(i)
                        loss.backward()
                    total += loss.detach()
                rep = mon.end_step(total, probe=loss_for)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if on_step is not None:
                on_step(step, rep.record)
    return mon, planted


__all__ = ["PARALLEL_BACKENDS", "ParallelGPT", "pipeline_stage", "run_rank", "tensor_parallel", "tp_plan"]
