"""The persistent-fault tests' one check of a flagged fault step, shared by the sampler's run
(tests/engine/test_persistent_faults.py) and the real-vLLM run (tests/vllm_tier/inside/test_persistent.py)."""
from __future__ import annotations

from typing import Any


def assert_localized(report: Any, context: Any = None) -> Any:
    """A flagged fault step is its own incident or a follow-up of an earlier one (never folded into an episode),
    located, with culprits; returns its localization. ``context`` goes into the failure messages."""
    assert report.incident is not None, (f"step {report.record.step} ({sorted(k.value for k in report.spike.kinds)}) "
                                         f"folded into step {report.spike.episode}'s episode", context)
    if report.spike.follows is not None:  # a follow-up: a new cause inside an earlier incident's episode
        assert report.spike.follows < report.record.step and "new cause" in report.spike.detail, report.spike
    loc = report.incident.localization
    assert loc is not None and loc.status == "located" and loc.culprits, (loc, context)
    return loc
