"""The spike path of a DDP / FSDP2 / DeepSpeed job: every rank localizes together, one incident comes out.

A spike is judged on the job's step, identically on every rank (collector/job.py), so every rank
enters this path together and runs the one :class:`~gradloc.localizer.Localizer` with its job's
scope (``dist_scope.py``: how a probe runs and combines under DDP, FSDP2 or ZeRO). Every rank ends
with the same localization; rank 0 emits the incident.

Every collective has a deadline (``JobComm``); a timeout becomes an ``unavailable`` localization
naming it, and a probe that raised on some rank an ``unavailable`` one naming the rank and the error.
Not done across ranks: bisection, and the decomposition probe under FSDP2 and ZeRO (their stored
gradient is sharded; the samples are measured by probes instead).
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager

from gradloc.adapters.dist import CollectiveTimeout, JobComm
from gradloc.adapters.dist_scope import scope_for
from gradloc.adapters.spike import SpikeInputs, SpikePath, outlier_samples, token_view
from gradloc.localizer import SpikeContext, StoredGradient
from gradloc.localizer.localizer import LocalizeResult
from gradloc.localizer.scope import ProbeFailed
from gradloc.records import IncidentScope, Localization, Method, Status

__all__ = ["DistSpikePath", "ProbeFailed"]


class DistSpikePath(SpikePath):
    scope = IncidentScope.JOB

    def __init__(self, *args: Any, comm: JobComm, kind: str, probe_context: Callable[[], ContextManager[Any]],
                 deepspeed: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.comm, self.kind, self.probe_context = comm, kind, probe_context
        self.deepspeed = deepspeed  # DeepSpeedLayerStats of a DeepSpeed engine (probes by autograd.grad)

    def _localize(self, x: SpikeInputs) -> LocalizeResult:
        try:
            return self._job_localize(x)
        except CollectiveTimeout as exc:
            self.counters["collective_timeouts"] += 1
            return LocalizeResult(self._unavailable(x, f"localization failed: {exc}"))
        except ProbeFailed as exc:  # every rank got here together: the job's collectives stay in lockstep
            self.counters["probe_errors"] += 1
            return LocalizeResult(self._unavailable(x, f"localization failed: {exc}"))
        except Exception as exc:  # never raise into the training loop (the other ranks time out)
            self.counters["localize_errors"] += 1
            return LocalizeResult(self._unavailable(x, f"localization failed on rank {self.comm.rank}: "
                                                       f"{type(exc).__name__}: {exc}"))

    def _unavailable(self, x: SpikeInputs, note: str) -> Localization:
        return Localization(step=x.record.step, method=Method.NONE, status=Status.UNAVAILABLE, probes=0,
                            global_norm=x.record.global_norm, note=note)

    def _job_localize(self, x: SpikeInputs) -> LocalizeResult:
        rec = x.record
        view = token_view(x.scores, self.token_layers, x.scale, x.unattributed_share, x.rl)
        stored = StoredGradient([p.grad for p in self.params], 1.0 if x.unscaled else 1.0 / x.scale, rec.global_norm)
        ctx = SpikeContext(x.spike.mean, x.job_loss, x.spike.loss_mean, x.spike.std, self.cfg.detector.z_threshold,
                           outliers=outlier_samples(rec))
        kind = "deepspeed" if self.deepspeed is not None else self.kind
        scope = scope_for(kind, comm=self.comm, model=self.model, params=self.params,
                          metas=x.scores.metas if x.scores is not None else (), probe=x.probe,
                          pause_hooks=self.pause_hooks, probe_context=self.probe_context, grads=stored.grads,
                          inv_scale=stored.inv_scale, norm=stored.norm, deepspeed=self.deepspeed)
        return self.localizer.localize(rec.step, view, stored, None, ctx, keep_grad=self.cfg.remedy == "drop_culprits",
                                       head=self.head_for(view), scope=scope, has_probe=x.probe is not None)
