"""JSONL sink: one incident (and optionally one step record) per line, flushed per write; each
per-sample finding of a step (``StepRecord.samples.outliers``) as a ``sample_outlier`` line
(``{"kind": "sample_outlier", "outlier": {...}}``), and each drift finding (``StepRecord.precursor_findings``) as a
``precursor_finding`` line (``{"kind": "precursor_finding", "finding": {...}}``).

A :class:`gradloc.sinks.Sink`: it never raises into training (the monitor counts failures).
"""
from __future__ import annotations

import json
import os
import threading
from typing import IO

from gradloc.records import Incident, StepRecord, to_dict


class JsonlSink:
    def __init__(self, path: str | os.PathLike[str], steps: bool = False) -> None:
        self.path, self.steps = os.fspath(path), steps
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        self._fh: IO[str] | None = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def _write(self, kind: str, payload: dict) -> None:
        with self._lock:
            if self._fh is None:
                return
            self._fh.write(json.dumps({"kind": kind, **payload}, ensure_ascii=False) + "\n")
            self._fh.flush()

    def on_step(self, record: StepRecord) -> None:
        if self.steps:
            self._write("step", to_dict(record))
        for outlier in record.samples.outliers if record.samples is not None else ():
            self._write("sample_outlier", {"outlier": to_dict(outlier)})  # its own "kind" stays inside
        for finding in record.precursor_findings:
            self._write("precursor_finding", {"finding": to_dict(finding)})

    def on_incident(self, incident: Incident) -> None:
        self._write("incident", to_dict(incident))

    def force_flush(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.flush()

    def shutdown(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


def read_incidents(path: str | os.PathLike[str]) -> list[dict]:
    """The incident objects of a JSONL file written by :class:`JsonlSink`."""
    with open(path, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return [r for r in rows if r.get("kind") == "incident"]
