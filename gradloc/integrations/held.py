"""``mon.micro_batch`` blocks held open across a framework's own methods.

verl and OpenRLHF run a micro-batch's forward in one method and its backward in the caller (verl:
``forward_step`` returns the loss, ``forward_backward_batch`` calls ``loss.backward()``), and Lightning
and Accelerate hand gradloc the two ends through callbacks (gradloc/integrations/loop.py), so no single
``with`` block can wrap both. :class:`HeldBlocks` enters the block when the forward starts and exits
it when the next forward starts, when the caller's loop returns, or just before ``end_step``. It
keeps one payload per block (what the probe closure needs) in the monitor's micro-batch order, and
applies gradloc's two error regimes: bad metadata raises a typed error on the first step (setup) and
is counted and skipped after it; nothing else it does ever raises into training.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable

from gradloc.errors import BatchMetadataError, GradlocError

log = logging.getLogger("gradloc")


class HeldBlocks:
    def __init__(self, mon: Any, tag: str, history: int = 64, strict: bool = True) -> None:
        self.mon, self.tag = mon, tag
        self.strict = strict  # False: a typed setup mistake on the first step is counted like a later one
        self.payloads: list[Any] = []  # one per micro-batch the monitor holds, in its order
        self.loss: Any = None  # Σ of the step's micro-batch losses (detached)
        self.reports: deque[Any] = deque(maxlen=history)
        self.stepped = False  # end_step has run at least once: setup is over
        self.errors = 0  # failures caught on the training path (each logged)
        self._cm: Any = None
        self._payload: Any = None

    @property
    def held(self) -> bool:
        return self._cm is not None

    def open(self, make_kwargs: Callable[[], dict[str, Any]], payload: Any = None) -> Any | None:
        """Close the held block, then enter one for this micro-batch; returns its meta, or None if the
        metadata was unusable after setup (counted; the micro-batch trains unwatched)."""
        self.close()
        try:
            cm = self.mon.micro_batch(**make_kwargs())
            meta = cm.__enter__()
        except Exception as exc:
            if self.strict and not self.stepped:
                if isinstance(exc, GradlocError):
                    raise
                raise BatchMetadataError(f"{self.tag}: this micro-batch cannot be mapped: {exc!r}") from exc
            self._count("skipped_micro_batches", "micro-batch left out of per-token statistics")
            return None
        self._cm, self._payload = cm, payload
        return meta

    def guard(self, fn: Callable[[], Any], what: str, setup_raises: bool = True) -> Any:
        """Run ``fn`` (RL fields, recording): errors raise at setup (unless ``setup_raises`` is False), and are
        counted and logged after it."""
        try:
            return fn()
        except Exception:
            if setup_raises and self.strict and not self.stepped:
                raise
            self._count(f"{what}_errors", f"{what} failed")
            return None

    def close(self, exc: BaseException | None = None) -> None:
        """Exit the held block — after its backward ran, or with the exception that interrupted it."""
        cm, payload = self._cm, self._payload
        if cm is None:
            return
        self._cm = self._payload = None
        try:
            if exc is None:
                cm.__exit__(None, None, None)
                self.payloads.append(payload)
            else:
                cm.__exit__(type(exc), exc, exc.__traceback__)  # the monitor drops the micro-batch
        except Exception as err:
            if err is exc:
                return
            if self.strict and not self.stepped and isinstance(err, GradlocError):
                raise
            self._count("block_errors", "closing a micro-batch block failed")

    def add_loss(self, loss: Any) -> None:
        value = loss.detach() if hasattr(loss, "detach") else loss
        self.loss = value if self.loss is None else self.loss + value

    def end_step(self, probe_for: Callable[[list[Any]], Any] | None, **kw: Any) -> Any | None:
        """Close the held block and run ``mon.end_step`` (``probe_for(payloads)`` builds the probe
        closure); None when no training micro-batch ran since the last call."""
        self.close()
        payloads, loss = self.payloads, self.loss
        self.payloads, self.loss = [], None
        if loss is None and not payloads:
            return None
        first, self.stepped = not self.stepped, True
        try:
            probe = probe_for(payloads) if probe_for is not None and payloads else None
            report = self.mon.end_step(loss, probe=probe, **kw)
        except Exception as exc:
            if self.strict and first and isinstance(exc, GradlocError):
                raise  # a typed setup mistake, before the first optimizer step
            self._count("end_step_errors", "end_step failed")
            return None
        self.reports.append(report)
        return report

    def drop_provenance(self, n: int) -> None:
        """``n`` rows of a batch whose provenance was invalid (they train, keeping none; the caller logged it)."""
        self.mon.note_event("integration_provenance_dropped", n)

    def skip(self, message: str) -> None:
        """A micro-batch the integration could not open a block for (trained, left out), counted."""
        self._count("skipped_micro_batches", message)

    def _count(self, counter: str, message: str) -> None:
        """One failure caught on the training path: counted (``integration_<counter>``, records/events.py) and
        logged with the integration's tag."""
        self.errors += 1
        self.mon.note_event(f"integration_{counter}")
        log.warning("gradloc (%s): %s", self.tag, message, exc_info=True)
