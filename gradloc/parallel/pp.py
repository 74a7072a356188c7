"""Pipeline parallelism with ``torch.distributed.pipelining``: one ``PipelineStage`` per rank, GPipe or 1F1B.

``gradloc.watch(stage, optimizer)``: the hooks and statistics go on ``stage.submod`` (its own
data-parallel wrapper, DDP or FSDP2, is the job's data backend); the stage index is this rank's ``pp``
coordinate and the job's layers are every stage's, in stage order. A step runs through the monitor,
in place of ``schedule.step`` (:class:`PipelineStep`)::

    losses = mon.pipeline_step(schedule, inputs=x, target=y, token_loss=token_loss)  # every stage
    report = mon.end_step(sum(losses) if losses else None)

- **micro-batches**: the schedule splits the batch along dim 0 into ``n_microbatches`` chunks; gradloc
  splits the token ids (``target`` unless ``token_ids`` is given), loss mask and sample ids the same way,
  and the stage's ``forward_one_chunk(k, …)`` runs in chunk k's block for the step (the stage's first-step
  shape inference runs its module outside any block), so every stage scores its own layers for the same tokens.
- **scores**: each stage's rows of the job's token layers; the token group (the stages of a data index)
  sums them once per step, so every stage holds the whole view; the labels and the loss head live on
  the last stage (the exact row, the per-sample surprise are its).
- **probes** (:class:`PipelineProbe`): micro-batch i with a token mask runs on every stage through the
  stage's own send/recv, forward and backward of chunk i — a GPipe of one chunk — the last stage's loss
  being ``(token_loss(output, target) · mask).sum()`` scaled as the schedule scales the training
  gradient (÷ n_microbatches under ``scale_grads``). ``token_loss(output, target)`` returns the per-token
  terms (B, T) whose sum is the schedule's ``loss_fn``. Under DDP the probe's backward runs without the
  gradient all-reduce (gradloc combines ∇_C); under FSDP2 the stage's gradient reduction runs after it
  (a collective over the data group: lockstep). Every send/recv of a probe is waited on with the job's
  deadline (the schedule's own waits have none): a stage that died leaves the others with an
  ``unavailable`` localization naming the rank that did not answer, and the job's collectives off.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from gradloc.errors import ConfigError
from gradloc.parallel.backend import ModelBackend, register_backend

TokenLoss = Callable[[Any, Any], torch.Tensor]  # (stage output, target) -> (B, T) per-token loss terms


def is_stage(obj: Any) -> bool:
    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:  # pragma: no cover - torch without pipelining
        return False
    return isinstance(obj, _PipelineStageBase)


@register_backend
class Pipeline(ModelBackend):
    name, dim, order = "pp", "pp", 5

    def __init__(self, stage: Any) -> None:
        self.stage = stage
        self._probe: PipelineProbe | None = None  # the last step's, for its end_step

    def run_step(self, mon: Any, schedule: Any, **kw: Any) -> list:
        """``mon.pipeline_step``: the schedule's step through the monitor (:class:`PipelineStep`)."""
        step = PipelineStep(mon, self, schedule)
        losses = step.run(**kw)
        self._probe = step.probe
        return losses

    def take_probe(self) -> "PipelineProbe | None":
        probe, self._probe = self._probe, None
        return probe

    @classmethod
    def detect(cls, model: Any, world: Any) -> "Pipeline | None":
        if world is None or not is_stage(model):
            return None
        from gradloc.errors import UnsupportedModelError
        from gradloc.parallel.unsupported import several_stages

        why = several_stages(model)
        if why:
            raise UnsupportedModelError(f"gradloc: {why}")
        return cls(model)

    def unwrap(self, model: Any) -> nn.Module:
        return self.stage.submod if model is self.stage else model

    def coords(self) -> dict[str, tuple[int, int]]:
        return {"pp": (int(self.stage.stage_index), int(self.stage.num_stages))}

    @property
    def fsdp(self) -> bool:
        from torch.distributed.fsdp import FSDPModule

        return isinstance(self.stage.submod, FSDPModule)


def chunks(t: Any, n: int) -> list[Any]:
    """``t`` split along dim 0 into ``n`` chunks as the schedule splits (``torch.tensor_split``); a list
    (of sample ids) likewise; None: n Nones."""
    if t is None:
        return [None] * n
    if isinstance(t, torch.Tensor):
        return list(torch.tensor_split(t, n, dim=0))
    idx = torch.tensor_split(torch.arange(len(t)), n)
    return [[t[int(i)] for i in part] for part in idx]


class PipelineProbe:
    """Micro-batch ``i`` with a token mask through every stage (module docstring). Returns the last stage's
    loss (0.0 on the others); the gradient accumulates into the parameters' ``.grad``."""

    runs_backward = True  # ProbeSession: the probe ran its own backward

    def __init__(self, stage: Any, n: int, scale: float, token_loss: TokenLoss | None, inputs: Sequence[Any],
                 targets: Sequence[Any], fsdp: bool, comm: Any) -> None:
        self.stage, self.n, self.scale, self.token_loss = stage, n, scale, token_loss
        self.inputs, self.targets, self.fsdp, self.comm = inputs, targets, fsdp, comm

    def __call__(self, i: int, mask: torch.Tensor) -> float:
        from torch.distributed.pipelining.schedules import _sorted_batch_p2p

        st = self.stage

        def run(ops: list) -> None:  # the stages' send/recv, each waited on with the job's deadline
            for peer, works in _sorted_batch_p2p(ops, desc="gradloc probe").items():
                for work in works:
                    self.comm.wait_p2p(work, peer, f"the pipeline probe's send/recv with rank {peer}")

        run(st.get_fwd_recv_ops(i))
        args = (self.inputs[i],) if st.is_first else ()
        out = st.forward_one_chunk(i, args, {}, save_forward_output=False)
        run(st.get_fwd_send_ops(i))
        loss, value = None, 0.0
        if st.is_last:
            if self.token_loss is None:
                raise ConfigError("pipeline probes need token_loss (per-token loss terms) on the last stage")
            terms = self.token_loss(out, self.targets[i])  # (B, T)
            loss = (terms * mask.to(terms.device, terms.dtype)).sum() * self.scale
            value = float(loss.detach())
        run(st.get_bwd_recv_ops(i))
        st.backward_one_chunk(i, loss=loss, last_backward=False)
        run(st.get_bwd_send_ops(i))
        if self.fsdp:
            st.perform_reduce_grad(1)  # FSDP2 deferred the reduce-scatter: into the parameters' .grad now
        return value


class PipelineStep:
    """One schedule step of a pipeline-parallel job through the monitor: its micro-batch blocks and probe."""

    def __init__(self, mon: Any, backend: Pipeline, schedule: Any) -> None:
        if getattr(schedule, "_stage", None) is not backend.stage:
            raise ConfigError("pipeline_step: the schedule must run the watched stage (a single-stage schedule: "
                              "ScheduleGPipe, Schedule1F1B)")
        spec = getattr(schedule, "_args_chunk_spec", None)
        if spec is not None and any(getattr(s, "split_dim", 0) != 0 for s in spec):
            raise ConfigError("pipeline_step: micro-batches must be split along dim 0 (the schedule's default)")
        self.mon, self.backend, self.schedule = mon, backend, schedule
        self.n = int(schedule._n_microbatches)
        self.probe: PipelineProbe | None = None  # set by run: the step's probe closure

    def run(self, *, inputs: Any, target: Any, token_ids: Any, loss_mask: Any, sample_ids: Any,
            token_loss: TokenLoss | None, step_kwargs: dict, sample_infos: Any = None) -> list:
        from gradloc.collector.batch import make_meta

        st, n, mon = self.backend.stage, self.n, self.mon
        ids = target if token_ids is None else token_ids
        if ids is None:
            raise ConfigError("pipeline_step needs the token ids (target, or token_ids=) on every stage")
        pieces = list(zip(chunks(ids, n), chunks(loss_mask, n), chunks(sample_ids, n), chunks(sample_infos, n)))
        seen: list[int] = []
        own = vars(st).get("forward_one_chunk")  # an instance-level wrapper someone else put there, kept
        inner = st.forward_one_chunk

        def forward_one_chunk(chunk: int, *a: Any, **kw: Any) -> Any:
            """Chunk k's forward in its block (its RNG state taken now, for probes). Keyed on the schedule's chunk
            id, not on the module's calls: the stage's first step also runs its module on placeholder tensors to
            infer shapes (torch >= 2.13 with gradients and a backward), which belongs to no micro-batch."""
            k = int(chunk)
            if not 0 <= k < n or k in seen or mon.block_open:
                return inner(chunk, *a, **kw)
            ids_k, mask_k, sids_k, infos_k = pieces[k]
            mon.open_block(make_meta(k, ids_k, mask_k, sids_k, None, sample_infos=infos_k))
            seen.append(k)
            try:
                out = inner(chunk, *a, **kw)
            except BaseException:
                mon.close_block(failed=True)
                raise
            mon.close_block()
            return out

        st.forward_one_chunk = forward_one_chunk
        losses: list = []
        try:
            args = (inputs,) if st.is_first and inputs is not None else ()
            kw = dict(step_kwargs)
            if st.is_last:
                kw.update(target=target, losses=losses)
            self.schedule.step(*args, **kw)
        finally:
            if own is None:
                del st.forward_one_chunk
            else:
                st.forward_one_chunk = own
            if mon.block_open:
                mon.close_block(failed=True)
        if len(seen) != n:
            raise ConfigError(f"pipeline_step: the stage ran {len(seen)} forwards for {n} micro-batches")
        scale = 1.0 / n if getattr(self.schedule, "scale_grads", True) else 1.0
        self.probe = PipelineProbe(st, n, scale, token_loss, chunks(inputs, n), chunks(target, n),
                                   self.backend.fsdp, mon.job.layout.world)
        return losses


__all__ = ["Pipeline", "PipelineProbe", "PipelineStep", "chunks", "is_stage"]
