"""How the precursor hooks see an attention's logits (collector/precursors/hooks.py decides where and when).

- :class:`AttentionMode`, a ``TorchFunctionMode``: every torch call while it is active passes through it; it hands
  on each ``F.scaled_dot_product_attention`` and each softmax. Discovery runs one micro-batch under it; after, an
  attention module that computes its softmax itself (eager) runs under it.
- :class:`SdpaSwap`: after discovery, an attention module that calls SDPA gets ``torch.nn.functional.
  scaled_dot_product_attention`` swapped for a thin wrapper during its own forward only (pre-hook in, post-hook
  out): no per-op dispatch for the module's other calls. TinyGPT's blocks ran 3–5% slower under the mode, the
  dispatch of every op of every block. The wrapper measures calls from the training thread inside a site only; a
  model that bound the function before the swap never reaches it (the hooks then go back to the mode).
- :func:`attention_call`: the statistics of one such call (measure.py), or None when it is not attention.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from gradloc.collector.precursors import measure

SDPA = F.scaled_dot_product_attention  # the function itself, whatever is swapped in later
_SOFTMAX = {torch.softmax, F.softmax, torch.Tensor.softmax, torch.nn.functional.softmax}


class Unsupported(Exception):
    """An attention call whose shapes the statistics do not understand (counted, not measured)."""


class AttentionMode(TorchFunctionMode):
    def __init__(self, on_call: Callable[[Any, tuple, dict], None]) -> None:
        super().__init__()
        self.on_call = on_call

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is SDPA or func in _SOFTMAX:
            self.on_call(func, args, kwargs)
        return out


class SdpaSwap:
    """``F.scaled_dot_product_attention`` swapped for a wrapper between ``enter`` and ``leave`` (nested: counted);
    the wrapper calls ``on_call(SDPA, args, kwargs)`` after the real call, from the thread that entered only."""

    def __init__(self, on_call: Callable[[Any, tuple, dict], None]) -> None:
        self.on_call, self.depth, self.hit = on_call, 0, False
        self._thread = 0
        self._saved: Any = None

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = self._saved(*args, **kwargs)
            if self.depth and threading.get_ident() == self._thread:
                self.hit = True
                self.on_call(SDPA, args, kwargs)
            return out
        self._wrapper = wrapper

    def enter(self) -> None:
        if not self.depth:
            self._thread, self._saved = threading.get_ident(), F.scaled_dot_product_attention
            F.scaled_dot_product_attention = self._wrapper
        self.depth += 1

    def leave(self) -> None:
        if self.depth:
            self.depth -= 1
            if not self.depth and F.scaled_dot_product_attention is self._wrapper:
                F.scaled_dot_product_attention = self._saved


def attention_call(func: Any, args: tuple, kwargs: dict, queries: int) -> dict[str, torch.Tensor] | None:
    """The statistics of one SDPA call (at ``queries`` sampled query rows) or of one softmax over attention weights
    (every row); None for a softmax that is not over 4-D weights' last dim (a router's, a head's). Raises
    :class:`Unsupported` for an SDPA call of other shapes."""
    if func is SDPA:
        q, k = args[0], args[1]
        if q.dim() != 4 or k.dim() != 4 or q.shape[1] % k.shape[1]:
            raise Unsupported(f"q {tuple(q.shape)}, k {tuple(k.shape)}")
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
        scale = args[6] if len(args) > 6 else kwargs.get("scale")
        rows = measure.query_rows(q.shape[2], queries, q.device)
        return measure.sampled_attention_stats(q, k, rows, mask, bool(causal), scale)
    x = softmax_input(args, kwargs)
    return None if x is None else measure.attention_stats(x.detach())


def softmax_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A softmax call's input when it is over the last dim of a 4-D tensor (attention weights' logits (B, H, T, S));
    None for any other softmax (a router's, a head's: not attention)."""
    x = args[0] if args else kwargs.get("input")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return x if isinstance(x, torch.Tensor) and x.dim() == 4 and dim in (-1, 3) else None


__all__ = ["SDPA", "AttentionMode", "SdpaSwap", "Unsupported", "attention_call", "softmax_input"]
