"""A module the token hooks watch: its rule, its token layer and the module whose forward is hooked. Its own module
so that the score buffer (scores_buffer.py) and the hooks (token_hooks.py) both name it without importing each
other."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from gradloc.collector.rules.registry import TokenRule


@dataclass(frozen=True)
class WatchedModule:
    name: str
    module: nn.Module
    rule: TokenRule
    layer: int  # index into the token-layer list
    site: nn.Module  # the module whose forward is hooked: ``module``, or the caller that carries its routing


__all__ = ["WatchedModule"]
