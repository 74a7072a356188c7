"""Where the precursor statistics are taken, found from the model's structure rather than from an eager forward
(hooks.py's discovery watches one; a compiled model runs none): whether modules are compiled in place, the loss
head and the final norm from the order modules with parameters run (or are registered) in, the attention modules
by the names their ``forward`` uses, and an attention module's head count from its attributes."""
from __future__ import annotations

import inspect
from types import CodeType

from torch import nn


def compiles_inside(model: nn.Module) -> bool:
    """Whether a module of ``model`` was compiled in place (``module.compile()``: torchtitan's per-block recipe)."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


def head_and_norm(model: nn.Module, order: list[str]) -> tuple[str | None, str | None]:
    """The loss head: the last module with parameters of its own in ``order``; the final norm: the one before it,
    when its class is a norm (None: none)."""
    if not order:
        return None, None
    before = dict(model.named_modules()).get(order[-2]) if len(order) > 1 else None
    return order[-1], order[-2] if before is not None and "norm" in type(before).__name__.lower() else None


def registered_order(model: nn.Module) -> list[str]:
    """The modules with trainable parameters of their own, in registration order (HF's ``lm_head`` is registered
    after the model: last)."""
    return [n for n, m in model.named_modules() if any(p.requires_grad for p in m.parameters(recurse=False))]


# names a module's own forward uses when it calls attention: SDPA itself, HF's dispatch to its attention functions
_MARKERS = frozenset({"scaled_dot_product_attention", "ALL_ATTENTION_FUNCTIONS", "eager_attention_forward"})


def _names(code: CodeType) -> set[str]:
    """The global and attribute names a code object and those nested in it (comprehensions, lambdas) use."""
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            out |= _names(const)
    return out


def forward_names(module: nn.Module) -> set[str]:
    """The names a module's own ``forward`` code uses (decorators unwrapped; none for a forward without Python
    code, a C extension's)."""
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
    return _names(code) if code is not None else set()


def attention_sites(model: nn.Module) -> list[str]:
    """The modules whose own ``forward`` calls attention (SDPA, or HF's attention dispatch), by the names its code
    uses."""
    return [name for name, module in model.named_modules() if _MARKERS & forward_names(module)]


_HEADS = ("num_heads", "n_heads", "num_attention_heads", "n_head")


def site_heads(module: nn.Module) -> int | None:
    """An attention module's query-head count from its attributes or its config's (None: found nowhere)."""
    for holder in (module, getattr(module, "config", None), getattr(module, "cfg", None)):
        for attr in _HEADS:
            value = getattr(holder, attr, None) if holder is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


__all__ = ["attention_sites", "compiles_inside", "forward_names", "head_and_norm", "registered_order", "site_heads"]
