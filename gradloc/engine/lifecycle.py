"""A monitor's lifecycle: attach (the token hooks when they run in training, the optimizer's update hooks, the
registry of attached models), detach (the model and optimizer exactly as before), close (the last record out, the
sinks flushed within ``close_timeout_s``; also at interpreter exit). :class:`~gradloc.engine.monitor.Monitor`
inherits it; its contract is the attributes ``Monitor.__init__`` sets: ``model``, ``optimizer``, ``tokens``,
``hooks``, ``layer_stats``, ``config``, ``_updates``, ``_fanout``."""
from __future__ import annotations

import atexit
import logging
import weakref
from typing import Any, Callable

from torch import nn

from gradloc.errors import AttachError
from gradloc.sinks import Sink

log = logging.getLogger("gradloc")
ATTACHED: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()  # model -> its monitor


class Lifecycle:
    model: nn.Module
    tokens: Any
    hooks: Any
    layer_stats: Any
    config: Any
    _updates: Any
    _fanout: Any
    precursors: Any

    def _lifecycle_init(self) -> None:
        self.attached = False
        self._closed = False
        self._atexit = _close_at_exit(weakref.ref(self))
        atexit.register(self._atexit)

    def attach(self) -> Any:
        if self.attached or self.model in ATTACHED:
            raise AttachError("this model already has a gradloc monitor attached; detach() it first")
        if self.tokens.live:
            self.hooks.attach()
        if self.precursors is not None:
            self.precursors.attach()
        self._updates.attach(self.optimizer)
        ATTACHED[self.model] = self
        self.attached = True
        return self

    def detach(self) -> None:
        """Remove every hook; the model and optimizer are left exactly as before ``attach``."""
        if not self.attached:
            raise AttachError("this monitor is not attached")
        if self.tokens.live:
            self.hooks.detach()
        if self.precursors is not None:
            self.precursors.detach()
        self._updates.detach()
        ATTACHED.pop(self.model, None)
        self.attached = False

    def close(self) -> None:
        """Emit the last record, flush and shut down sinks, detach. Safe to call twice.

        Waits on a ``gradloc-agent`` daemon at most ``WatchConfig.close_timeout_s`` (default 1 s),
        whether it is down, stalled or slow; what it could not deliver is counted
        (``counters["undelivered_at_close"]``) and logged. Also runs at interpreter exit."""
        atexit.unregister(self._atexit)
        if self._closed:
            return
        self._closed = True
        ratios = self._updates.host_ratios(self._fanout.held_step, self.layer_stats.sharded)
        self._fanout.release(ratios, self.layer_stats.layers)
        self._fanout.close(self.config.close_timeout_s)
        if self.attached:
            self.detach()

    @property
    def sinks(self) -> list[Sink]:
        """Where the records go: the ``sinks`` given, then those ``watch`` added (JSONL, agent)."""
        return self._fanout.sinks

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_at_exit(ref: "weakref.ref[Lifecycle]") -> Callable[[], None]:
    """Interpreter exit closes a monitor the script left open (bounded like close())."""
    def hook() -> None:
        mon = ref()
        if mon is not None:
            try:
                mon.close()
            except Exception:  # noqa: BLE001 - never fail the interpreter's exit
                log.warning("gradloc: closing the monitor at exit failed", exc_info=True)
    return hook


__all__ = ["ATTACHED", "Lifecycle"]
