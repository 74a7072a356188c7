"""The precursor statistics of the modules that are not attention: the loss head's output logits, the final norm's
input (the residual stream) and a MoE router's logits and choices — each a hook method of :class:`PrecursorHooks`
(collector/precursors/hooks.py), which finds the modules and owns the state these read (``cfg``, ``slots``,
``names``, ``micro_batch``, ``keep``, ``counters``). No exception leaves a hook: a failure is counted
(``precursors_errors``), a shape not understood too (``precursors_unsupported``)."""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from gradloc.collector.precursors import measure
from gradloc.collector.precursors.slots import Reduce, SlotKey

log = logging.getLogger("gradloc")


class ModuleStats:
    def _on_head(self, module: nn.Module, out: Any) -> None:
        logits = out[0] if isinstance(out, (tuple, list)) and out else getattr(out, "logits", out)
        if not self.cfg.head_logits or not isinstance(logits, torch.Tensor):
            return
        try:
            with torch.no_grad():
                if logits.dim() != 3:
                    self.counters["precursors_unsupported"] += 1
                    return
                logits, offset = measure.local_view(logits.detach())  # a DTensor: this rank's shard
                keep = self.keep if self.keep is not None and self.keep.shape == logits.shape[:2] else None
                s = measure.head_stats(logits, keep.to(logits.device) if keep is not None else None,
                                       self.cfg.head_positions)
                name, mb = self.names.get(module, ""), self.micro_batch
                self.slots.update(SlotKey("logit_max_abs", name, Reduce.MAX, 1), s["max_abs"], micro_batch=mb,
                                  extreme=s["max_abs"], at=measure.shifted(s["max_at"], offset))
                self.slots.update(SlotKey("logit_lse_sq", name, Reduce.SUM, 1), s["lse_sq_sum"], micro_batch=mb,
                                  count=s["n"])
        except Exception:
            self.counters["precursors_errors"] += 1
            log.debug("gradloc: head precursors failed", exc_info=True)

    def _on_norm(self, module: nn.Module, args: tuple) -> None:
        if not self._measuring() or not args or not isinstance(args[0], torch.Tensor):
            return
        try:
            with torch.no_grad():
                x = args[0].detach()
                if x.dim() != 3:
                    self.counters["precursors_unsupported"] += 1
                    return
                x, offset = measure.local_view(x)  # sequence parallelism: this rank's positions of every row
                s = measure.rms_stats(x)
                self.slots.update(SlotKey("residual_rms", self.names.get(module, ""), Reduce.SUM, 1), s["sum"],
                                  micro_batch=self.micro_batch, count=s["n"], extreme=s["max"],
                                  at=measure.shifted(s["max_at"], offset))
        except Exception:
            self.counters["precursors_errors"] += 1
            log.debug("gradloc: residual precursors failed", exc_info=True)

    def _router_hook(self, name: str):
        def hook(module: nn.Module, args: tuple, out: Any) -> None:
            if not self._measuring():
                return
            try:
                with torch.no_grad():
                    logits = out[0] if isinstance(out, tuple) else out
                    chosen = out[2] if isinstance(out, tuple) and len(out) > 2 and isinstance(out[2], torch.Tensor) \
                        and not out[2].is_floating_point() else None
                    s = measure.router_stats(logits.detach(), chosen, int(getattr(module, "top_k", 1)))
                    E = s["counts"].numel()
                    self.slots.update(SlotKey("router", name, Reduce.SUM, 1 + E),
                                      torch.cat([s["entropy_sum"].reshape(1), s["counts"]]),
                                      micro_batch=self.micro_batch, count=s["n"])
            except Exception:
                self.counters["precursors_errors"] += 1
                log.debug("gradloc: router precursors failed in %s", name, exc_info=True)
        return hook
