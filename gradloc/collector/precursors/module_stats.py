"""The precursor statistics of the modules that are not attention: the loss head's output logits, the final norm's
input (the residual stream) and a MoE router's logits and choices — each a hook method of :class:`PrecursorHooks`
(collector/precursors/hooks.py), which finds the modules and owns the state these read (``cfg``, ``slots``,
``folds``, ``micro_batch``, ``keep``, ``counters``, ``tensor_parallel``, ``tp_rank``, ``parts_taken``, ``head``,
``final_norm``, ``_handles``). Eagerly a call's values
go to the step's slots; traced into a compiled graph, to the module's accumulators
(collector/precursors/compiled.py), and eagerly too where the key has one. The attention sites' slot keys are here
too (hooks.py and traced_attention.py fold into them). No exception leaves a hook: a failure is counted
(``precursors_errors``), a shape not understood too (``precursors_unsupported``).
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from gradloc.collector.precursors import measure
from gradloc.collector.precursors.slots import Reduce, SlotKey
from gradloc.collector.rules.megatron import is_megatron_linear, is_megatron_module, sp_marked

log = logging.getLogger("gradloc")


def head_keys(name: str) -> tuple[SlotKey, SlotKey]:
    return SlotKey("logit_max_abs", name, Reduce.MAX, 1), SlotKey("logit_lse_sq", name, Reduce.SUM, 1)


def attention_keys(site: str, heads: int) -> tuple[SlotKey, SlotKey]:
    """An attention site's slots: per head its largest logit; its rows' entropy sums and row counts."""
    return (SlotKey("attn_max_logit", site, Reduce.MAX, heads),
            SlotKey("attn_entropy", site, Reduce.SUM, 2 * heads, lowest=True))


def lse_parts_key(name: str, positions: int) -> SlotKey:
    """Under tensor parallelism: the step's first head call's logsumexp at each sampled position, as this rank's head
    computed it — a vocabulary shard's when the head's logits are split, combined over the shards on the host
    (collector/precursors/job.py)."""
    return SlotKey("logit_lse_parts", name, Reduce.SUM, positions)


def norm_key(name: str) -> SlotKey:
    return SlotKey("residual_rms", name, Reduce.SUM, 1)


def router_key(name: str, experts: int) -> SlotKey:
    return SlotKey("router", name, Reduce.SUM, 1 + experts)  # [Σ entropy | tokens per expert (E)]


class ModuleStats:
    def _hook_head_and_norm(self, modules: dict[str, Any]) -> None:
        """The hooks on the loss head and the final norm (found by hooks.py), read in the layout their caller uses:
        Megatron's output layer returns ``[s, b, V]``; a norm called by a Megatron block gets ``[s, b, h]``, and one
        in a sequence-parallel region (its parameters marked so) this tp rank's block of the sequence."""
        head, norm = self.head, self.final_norm
        first = head is not None and is_megatron_linear(modules[head])
        if head is not None and self.cfg.head_logits:
            self._handles.append(modules[head].register_forward_hook(
                lambda m, a, out: self._on_head(head, out, first) if self._live() else None))
            for key in head_keys(head) if self.folds is not None else ():
                self.folds.prepare(key)
            if self.folds is not None and self.tensor_parallel and self.cfg.head_positions:
                self.folds.prepare(lse_parts_key(head, self.cfg.head_positions))  # padded to its size (_on_head)
        if norm is not None and self.cfg.residual:
            lay = (is_megatron_module(modules[norm.rpartition(".")[0]]),  # its caller (the model: "")
                   self.tensor_parallel and sp_marked(modules[norm]))
            self._handles.append(modules[norm].register_forward_pre_hook(lambda m, a: self._on_norm(norm, a, *lay)))
            if self.folds is not None:
                self.folds.prepare(norm_key(norm))

    def _record(self, key: SlotKey, value: torch.Tensor, count: torch.Tensor | float = 1.0,
                extreme: torch.Tensor | None = None, at: torch.Tensor | None = None, attention: bool = False) -> None:
        """One call's values: into the key's accumulator inside a compiled graph (collector/precursors/compiled.py),
        and eagerly too where the key has one (a module that may run either way, as a head outside blocks compiled
        in place: one place per key); else into the step's slots."""
        if self.folds is not None and (torch.compiler.is_compiling() or key in self.folds.acc):
            self.folds.fold(key, value, count, extreme, at, attention=attention)
        else:
            self.slots.update(key, value, micro_batch=self.micro_batch, count=count, extreme=extreme, at=at)

    def _on_head(self, name: str, out: Any, seq_first: bool = False) -> None:
        """``seq_first``: the logits are ``[s, b, V]`` (Megatron's output layer): read as (B, T, V)."""
        logits = out[0] if isinstance(out, (tuple, list)) and out else getattr(out, "logits", out)
        if not self.cfg.head_logits or not isinstance(logits, torch.Tensor):
            return
        if seq_first and logits.dim() == 3:
            logits = logits.transpose(0, 1)  # [s, b, V] -> (B, T, V), a view
        try:
            with torch.no_grad():
                if logits.dim() != 3:
                    self.counters["precursors_unsupported"] += 1
                    return
                logits, offset = measure.local_view(logits.detach())  # a DTensor: this rank's shard
                keep = self.keep if self.keep is not None and self.keep.shape == logits.shape[:2] and \
                    not torch.compiler.is_compiling() else None  # compiled: every sampled position
                s = measure.head_stats(logits, keep.to(logits.device) if keep is not None else None,
                                       self.cfg.head_positions)
                top, lse = head_keys(name)
                self._record(top, s["max_abs"], extreme=s["max_abs"], at=measure.shifted(s["max_at"], offset))
                self._record(lse, s["lse_sq_sum"], count=s["n"])
                if self.tensor_parallel:
                    self._lse_parts(name, s["lse"])
        except Exception:
            self.counters["precursors_errors"] += 1
            log.debug("gradloc: head precursors failed", exc_info=True)

    def _lse_parts(self, name: str, lse: torch.Tensor) -> None:
        """Under tensor parallelism, the step's first head call's per-position logsumexps (lse_parts_key). Inside
        a compiled graph (and eagerly too once the key has an accumulator) they are padded with −inf to
        ``head_positions`` (a micro-batch of fewer positions: every one) and the accumulator keeps the step's first
        call; eagerly, a flag does (take() starts the next step over)."""
        key = lse_parts_key(name, self.cfg.head_positions)
        if self.folds is not None and (torch.compiler.is_compiling() or key in self.folds.acc):
            if lse.numel() <= key.size:
                pad = lse.new_full((key.size - lse.numel(),), float("-inf"))  # (P − P',): not a position
                self.folds.fold(key, torch.cat([lse.reshape(-1), pad]), first=True)
            return
        if not self.parts_taken and not torch.compiler.is_compiling():
            self.parts_taken = True
            self._record(lse_parts_key(name, lse.numel()), lse)

    def _on_norm(self, name: str, args: tuple, seq_first: bool = False, sequence_parallel: bool = False) -> None:
        """``seq_first``: the input is ``[s, b, h]`` (a Megatron block's): read as (B, T, h). ``sequence_parallel``:
        its positions are this tp rank's block of the sequence (parameters marked ``sequence_parallel``)."""
        if not self._live() or not args or not isinstance(args[0], torch.Tensor):
            return
        try:
            with torch.no_grad():
                x = args[0].detach()
                if x.dim() != 3:
                    self.counters["precursors_unsupported"] += 1
                    return
                if seq_first:
                    x = x.transpose(0, 1)  # [s, b, h] -> (B, T, h), a view
                x, offset = measure.local_view(x)  # sequence parallelism: this rank's positions of every row
                if sequence_parallel:  # Megatron's split: tp rank r holds positions [r·s/tp, (r+1)·s/tp)
                    offset += self.tp_rank * x.shape[1]
                s = measure.rms_stats(x)
                self._record(norm_key(name), s["sum"], count=s["n"], extreme=s["max"],
                             at=measure.shifted(s["max_at"], offset))
        except Exception:
            self.counters["precursors_errors"] += 1
            log.debug("gradloc: residual precursors failed", exc_info=True)

    def _router_hook(self, name: str):
        def hook(module: Any, args: tuple, out: Any) -> None:
            if not self._live():
                return
            try:
                with torch.no_grad():
                    logits = out[0] if isinstance(out, tuple) else out
                    chosen = out[2] if isinstance(out, tuple) and len(out) > 2 and isinstance(out[2], torch.Tensor) \
                        and not out[2].is_floating_point() else None
                    s = measure.router_stats(logits.detach(), chosen, int(getattr(module, "top_k", 1)))
                    self._record(router_key(name, s["counts"].numel()),
                                 torch.cat([s["entropy_sum"].reshape(1), s["counts"]]), count=s["n"])
            except Exception:
                self.counters["precursors_errors"] += 1
                log.debug("gradloc: router precursors failed in %s", name, exc_info=True)
        return hook
