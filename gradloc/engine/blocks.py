"""The step's micro-batches in flight: the block being run, those done with their per-token scores, and their
RL fields, until ``Monitor.end_step`` takes them."""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Mapping

import torch

from gradloc.collector import rl_fields
from gradloc.collector.batch import MicroBatchMeta
from gradloc.collector.overhead import OverheadMeter
from gradloc.collector.scores_buffer import MicroBatchScores
from gradloc.collector.token_hooks import TokenHooks
from gradloc.config import WatchConfig
from gradloc.engine.token_path import TokenPath
from gradloc.errors import BatchMetadataError

log = logging.getLogger("gradloc")
Part = tuple[MicroBatchMeta, MicroBatchScores | None]  # a micro-batch and its per-token scores (None: not scored)


class StepBlocks:
    def __init__(self, tokens: TokenPath, hooks: TokenHooks | None, meter: OverheadMeter, config: WatchConfig,
                 samples: Any, counters: Counter[str], precursors: Any = None) -> None:
        self.tokens, self.hooks, self.meter, self.config = tokens, hooks, meter, config
        self.precursors = precursors  # collector/precursors/hooks.py (None: off)
        self.samples, self.counters = samples, counters
        self.parts: list[Part] = []
        self.open: MicroBatchMeta | None = None  # the micro-batch block being run
        self.rl: dict[int, rl_fields.RLTensors] = {}  # micro-batch index -> its RL fields

    def begin(self, meta: MicroBatchMeta) -> None:
        """Start capturing micro-batch ``meta``."""
        t0 = self.meter.begin()
        if self.tokens.live:
            breakdown = self.config.layer_breakdown and not self.meter.is_shed("layer_breakdown")
            self.hooks.begin(meta.index, meta.batch, meta.seq, breakdown, labels=self.samples.labels(meta))
        if self.precursors is not None:
            self.precursors.begin(meta.index, meta.loss_mask)
        self.meter.end(t0)
        self.open = meta

    def end(self, failed: bool, setup: bool) -> None:
        """The open block's backward ran (or, ``failed``, it did not: the micro-batch is not part of the step).
        ``setup``: a wiring mistake raises (the first step of a strict monitor)."""
        meta, self.open = self.open, None
        if self.precursors is not None:
            self.precursors.end()
        if failed:
            if self.tokens.live:
                self.hooks.end()
            self.rl.pop(meta.index, None)
            self.counters["failed_micro_batches"] += 1  # e.g. an OOM the user retries: not part of the step
            return
        buf = self.hooks.end() if self.tokens.live else None
        self.parts.append((meta, buf))
        if buf is not None:
            self.tokens.check_wiring(buf, setup=setup)

    def rl_fields(self, fields: Mapping[str, torch.Tensor | None], setup: bool) -> None:
        """The open block's RL fields (``Monitor.rl_fields``): a wrong field raises during setup, is counted and
        dropped after it."""
        meta = self.open
        if meta is None:
            raise BatchMetadataError("rl_fields() must be called inside a mon.micro_batch(...) block")
        try:
            self.rl[meta.index] = rl_fields.make_rl(meta, fields)
        except BatchMetadataError:
            if setup:
                raise
            self.counters["dropped_rl_fields"] += 1
            log.warning("gradloc: RL fields of micro-batch %d dropped", meta.index, exc_info=True)

    def take(self) -> tuple[list[Part], dict[int, rl_fields.RLTensors]]:
        """The step's micro-batches and RL fields; the next step starts empty."""
        parts, rl = self.parts, self.rl
        self.parts, self.rl = [], {}
        return parts, rl


__all__ = ["Part", "StepBlocks"]
