"""The demo: train a small causal LM, plant a culprit, detect and localize the spike.

Library code (no click): ``gradloc.agent.cli`` turns flags into a :class:`DemoConfig`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

from gradloc.adapters.pytorch import watch
from gradloc.config import DetectorConfig, WatchConfig
from gradloc.demo.data import cl100k_corpus, provenance
from gradloc.demo.model import GPTConfig, TinyGPT, token_losses
from gradloc.errors import ConfigError
from gradloc.records import Incident, StepRecord

INJECT_KINDS = ("advantage", "label", "none")
BACKENDS = ("ddp", "fsdp", "deepspeed", "tp", "fsdp-tp", "pp")
MODEL_PARALLEL = ("tp", "fsdp-tp", "pp")  # gradloc/demo/parallel.py: the culprit on data rank 1
PLANT_RANK = 1  # a multi-rank demo plants its culprit on rank 1: the incident must name it


@dataclass(frozen=True)
class DemoConfig:
    seed: int = 0
    steps: int = 200
    inject_step: int = 180
    inject: str = "advantage"  # "advantage" | "label"
    micro_batches: int = 4
    batch: int = 4
    seq: int = 64
    d_model: int = 64
    n_layers: int = 2
    lr: float = 6e-3
    advantage: float = 300.0  # per-token loss weight of the planted RL token (others: 1)
    prompt: int = 8  # leading positions with no loss (like a prompt): they lack the context to predict
    detector_alpha: float = 0.9  # a short run: the EMA must forget the steep start of training
    incident_path: str | None = None
    job: str = "demo"
    rank: int = 0  # several demo processes with the same job and world_size act as the ranks of one job
    world_size: int = 1
    backend: str | None = None  # "ddp" | "fsdp" | "deepspeed": the demo spawns world_size ranks of one job
    zero_stage: int = 2  # backend="deepspeed": the ZeRO stage (0-3)
    agent: str | None = None  # ship to a gradloc-agent daemon at host:port (else embedded mode)
    store_path: str | None = None  # embedded mode's SQLite store (None: the per-user default)
    metrics_address: str | None = None  # embedded mode: serve /metrics and /api here
    threads: int = 1  # torch intra-op threads: the model is tiny, more threads only add synchronization

    def __post_init__(self) -> None:
        if self.inject not in INJECT_KINDS:
            raise ConfigError(f"inject must be one of {INJECT_KINDS}, got {self.inject!r}")
        if not 0 <= self.inject_step < self.steps:
            raise ConfigError(f"inject_step must be in [0, steps={self.steps}), got {self.inject_step}")
        if self.inject_step < 26:
            raise ConfigError("inject_step must be >= 26: the detector warms up on the first 25 steps")
        if min(self.micro_batches, self.batch, self.seq) < 1:
            raise ConfigError("micro_batches, batch and seq must be >= 1")
        if self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {self.threads}")
        if not 0 <= self.prompt < self.seq // 2:
            raise ConfigError(f"prompt must be in [0, seq/2), got {self.prompt}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.backend is not None and self.world_size < 2:
            raise ConfigError(f"backend={self.backend!r} needs world_size >= 2 (the demo plants on rank {PLANT_RANK})")
        if self.backend in MODEL_PARALLEL and (self.world_size < 4 or self.world_size % 2):
            raise ConfigError(f"backend={self.backend!r} needs an even world_size >= 4: two tp ranks or pipeline "
                              f"stages per data rank, and the culprit goes on data rank {PLANT_RANK}")


@dataclass(frozen=True)
class Planted:
    micro_batch: int
    sample: int
    position: int
    token_id: int
    rank: int = 0


@dataclass
class DemoResult:
    planted: list[Planted]
    incidents: list[Incident]
    records: list[StepRecord] = field(default_factory=list)
    to_text: Callable[[list[int]], str] | None = None
    store_path: str | None = None  # embedded mode: where the incidents were stored


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` intra-op threads (None: leave torch's setting), restoring the old count."""
    old = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def run_demo(cfg: DemoConfig, on_step: Callable[[int, StepRecord], None] | None = None) -> DemoResult:
    with torch_threads(cfg.threads):
        return _run_model_parallel(cfg, on_step) if cfg.backend in MODEL_PARALLEL else _run(cfg, on_step)


def _run_model_parallel(cfg: DemoConfig, on_step: Callable[[int, StepRecord], None] | None) -> DemoResult:
    """One rank of the tp / fsdp-tp / pp demo (gradloc/demo/parallel.py), on the same text as the core demo."""
    from gradloc.demo.parallel import run_rank

    corpus = cl100k_corpus()
    wcfg = WatchConfig(job=cfg.job, rank=cfg.rank, world_size=cfg.world_size, incident_path=cfg.incident_path,
                       agent=cfg.agent, store_path=cfg.store_path, metrics_address=cfg.metrics_address,
                       detector=DetectorConfig(alpha=cfg.detector_alpha))
    mon, planted = run_rank(cfg, corpus.vocab, on_step,
                            lambda gen: [corpus.windows(gen, cfg.batch, cfg.seq) for _ in range(cfg.micro_batches)],
                            lambda model, opt: watch(model, opt, config=wcfg, decode=corpus.to_text))
    return DemoResult([Planted(*p) for p in planted], list(mon.incidents), [], corpus.to_text, store_path(mon))


def _wrap(cfg: DemoConfig, model: nn.Module) -> nn.Module:
    """The model as the backend trains it (every rank starts from the same seed)."""
    if cfg.backend == "deepspeed":
        from gradloc.demo.ds import engine

        return engine(model, cfg.zero_stage, cfg.batch, cfg.micro_batches, cfg.lr)
    if cfg.backend == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if cfg.backend == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model


def _run(cfg: DemoConfig, on_step: Callable[[int, StepRecord], None] | None) -> DemoResult:
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed + (1000 * cfg.rank if cfg.backend else 0))  # each rank its own data
    corpus = cl100k_corpus()
    model = _wrap(cfg, TinyGPT(GPTConfig(vocab=corpus.vocab, seq=cfg.seq, d_model=cfg.d_model, n_layers=cfg.n_layers)))
    ds = cfg.backend == "deepspeed"  # the engine owns the optimizer, clips, and divides each loss by M
    net = model.module if ds else model  # what probes and the plant's forward run (DeepSpeed: the raw module)
    opt = None if ds else torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    wcfg = WatchConfig(job=cfg.job, rank=cfg.rank, world_size=cfg.world_size, incident_path=cfg.incident_path,
                       agent=cfg.agent, store_path=cfg.store_path, metrics_address=cfg.metrics_address,
                       detector=DetectorConfig(alpha=cfg.detector_alpha))
    mon = watch(model, opt, config=wcfg, decode=corpus.to_text)
    planted: list[Planted] = []
    records: list[StepRecord] = []
    n_tokens = cfg.micro_batches * cfg.batch * (cfg.seq - cfg.prompt)
    loss_mask = torch.ones(cfg.batch, cfg.seq, dtype=torch.bool)
    loss_mask[:, : cfg.prompt] = False
    plants_here = cfg.inject != "none" and (cfg.backend is None or cfg.rank == PLANT_RANK)
    with mon:
        for step in range(cfg.steps):
            windows = [corpus.windows(gen, cfg.batch, cfg.seq) for _ in range(cfg.micro_batches)]
            batches, infos = [(x, y) for x, y, _ in windows], [provenance(starts) for _, _, starts in windows]
            weights = loss_mask.float().expand(cfg.micro_batches, -1, -1).clone()  # (M, B, T) per-token weights
            if step == cfg.inject_step and cfg.inject != "none":
                plant = _plant(cfg, net, batches, weights, gen, apply=plants_here)  # every rank runs its forward
                planted += [plant] if plants_here else []

            def loss_for(i: int, mask: torch.Tensor | None = None, fwd: nn.Module = net) -> torch.Tensor:
                x, y = batches[i]
                w = weights[i] if mask is None else weights[i] * mask
                return (token_losses(fwd(x), y) * w).sum() / n_tokens * (cfg.micro_batches if ds else 1)

            total = torch.zeros(())
            for i, (_, y) in enumerate(batches):
                uids = [f"s{step}-{i}-{b}" if cfg.backend is None else f"r{cfg.rank}-s{step}-{i}-{b}"
                        for b in range(cfg.batch)]
                sync = model.no_sync() if cfg.backend == "ddp" and i < cfg.micro_batches - 1 else contextlib.nullcontext()
                with sync, mon.micro_batch(y, loss_mask=loss_mask, sample_ids=uids, sample_infos=infos[i]):
                    loss = loss_for(i, fwd=model)
                    model.backward(loss) if ds else loss.backward()
                total += loss.detach() / (cfg.micro_batches if ds else 1)
                if ds and i < cfg.micro_batches - 1:
                    model.step()  # DeepSpeed: every micro-batch; the optimizer steps at the boundary only
            report = mon.end_step(total, probe=loss_for)
            if ds:
                model.step()  # clips (gradient_clipping 1.0) and steps
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            records.append(report.record)
            if on_step is not None:
                on_step(step, report.record)
    store = store_path(mon)
    return DemoResult(planted, list(mon.incidents), records, corpus.to_text, store)


def store_path(mon: Any) -> str | None:
    """Where the monitor's embedded agent stores incidents (None without one)."""
    return next((getattr(s, "store_path", None) for s in mon.sinks if getattr(s, "store_path", None)), None)


def _plant(cfg: DemoConfig, model: nn.Module, batches: list, weights: torch.Tensor,
           gen: torch.Generator, apply: bool = True) -> Planted:
    """Choose the culprit token and plant it (``apply``). Every rank of a job runs the forward (an
    FSDP2 or DDP forward is a collective), only the planting rank changes its batch."""
    mb = int(torch.randint(0, cfg.micro_batches, (1,), generator=gen))
    b = int(torch.randint(0, cfg.batch, (1,), generator=gen))
    x, y = batches[mb]
    with torch.no_grad():
        logp = torch.log_softmax(model(x[b : b + 1])[0].float(), dim=-1)  # (1, T, V) -> (T, V)
    if not apply:
        return Planted(mb, b, 0, 0, cfg.rank)
    lo = max(cfg.prompt, cfg.seq // 4)
    if cfg.inject == "advantage":  # RL-style: a sampled low-probability token with a huge weight
        t = lo + int(logp[lo:].gather(1, y[b, lo:, None]).squeeze(1).argmin())
        weights[mb, b, t] = cfg.advantage
    else:  # a corrupted label: where the model is surest, the token it finds least likely
        t = lo + int(logp[lo:].max(dim=-1).values.argmax())
        y = y.clone()  # labels are a view of the inputs' window: corrupt the target only
        y[b, t] = int(logp[t].argmin())
        batches[mb] = (x, y)
    return Planted(mb, b, t, int(y[b, t]), cfg.rank)
