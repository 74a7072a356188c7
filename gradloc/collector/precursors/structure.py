"""Where the precursor statistics are taken, found from the model's structure rather than from an eager forward
(hooks.py's discovery watches one; a compiled model runs none): whether modules are compiled in place, the loss
head and the final norm from the order modules with parameters run (or are registered) in, the attention modules
by the names their ``forward`` uses, and an attention module's head count from its attributes."""
from __future__ import annotations

import dis
import inspect
from types import CodeType

import torch
import torch.nn.functional as F
from torch import nn

from gradloc.collector.rules.router import is_router


def compiled_in_place(model: nn.Module) -> list[str]:
    """The modules of ``model`` compiled in place (``module.compile()``: torchtitan's per-block recipe), by name."""
    return [n for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]


def compiles_inside(model: nn.Module) -> bool:
    """Whether a module of ``model`` was compiled in place."""
    return bool(compiled_in_place(model))


def inside(name: str, regions: list[str]) -> bool:
    """Whether module ``name`` is one of ``regions`` or inside one ("" is the whole model)."""
    return any(r == "" or name == r or name.startswith(r + ".") for r in regions)


def complete_order(model: nn.Module, order: list[str]) -> list[str]:
    """The forward order an eager discovery saw (modules with parameters of their own), with the ones it could not
    see because they are compiled in place themselves — their hooks run only while dynamo traces them (a head, a
    final norm compiled on its own) — put where registration order places them: after the last seen module
    registered before them. The modules inside a compiled block are left out: their forward place is not known
    (the block is not seen either), and none of them is the head or the final norm a discovery looks for."""
    regions = set(compiled_in_place(model))
    if not regions:
        return order
    out, registered = list(order), registered_order(model)
    for i, name in enumerate(registered):
        if name in out or name not in regions:
            continue
        before = next((registered[j] for j in range(i - 1, -1, -1) if registered[j] in out), None)
        out.insert(len(out) - out[::-1].index(before) if before is not None else 0, name)  # after its last run
    return out


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


def calls_attention(module: nn.Module) -> bool:
    """Whether a module's own ``forward`` calls SDPA or HF's attention dispatch, by the names its code uses."""
    return bool(_MARKERS & forward_names(module))


def attention_sites(model: nn.Module) -> list[str]:
    """The modules whose own ``forward`` calls attention, by the names its code uses: SDPA or HF's attention
    dispatch; or a softmax, in a module with a head count (a hand-written attention: a router calls softmax too,
    and has no head count — and is known by type, left out)."""
    return [name for name, module in model.named_modules() if calls_attention(module) or (
        "softmax" in forward_names(module) and site_heads(module) is not None and not is_router(module))]


def softmax_as_method(module: nn.Module) -> bool:
    """Whether a module's own ``forward`` calls ``softmax`` as a tensor method (``att.softmax(-1)``), by its
    bytecode: the name loaded as an attribute of anything but ``torch``, ``torch.nn.functional`` or a ``functional``
    attribute (``F.softmax``, ``torch.softmax``, ``nn.functional.softmax`` are functions; ``self.softmax`` is a
    submodule, an ``nn.Softmax``, which calls ``F.softmax``). Its own code only, not nested code objects."""
    fn = inspect.unwrap(type(module).forward)
    code, spaces = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    if code is None:
        return False
    functions = {id(torch), id(F)}
    prev = None
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and ins.argval == "softmax":
            if prev is None or not ((prev.opname == "LOAD_GLOBAL" and id(spaces.get(prev.argval)) in functions)
                                    or (prev.opname == "LOAD_ATTR" and prev.argval == "functional")
                                    or (prev.opname == "LOAD_FAST" and prev.argval == "self")):  # nn.Softmax
                return True
        prev = ins
    return False


_HEADS = ("num_heads", "n_heads", "num_attention_heads", "n_head")


def site_heads(module: nn.Module) -> int | None:
    """An attention module's query-head count from its attributes or its config's (None: found nowhere)."""
    for holder in (module, getattr(module, "config", None), getattr(module, "cfg", None)):
        for attr in _HEADS:
            value = getattr(holder, attr, None) if holder is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


__all__ = ["attention_sites", "calls_attention", "softmax_as_method", "compiled_in_place", "compiles_inside",
           "complete_order", "inside", "forward_names", "head_and_norm", "registered_order", "site_heads"]
