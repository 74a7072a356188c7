"""The store's retention limits are counted where operators look: gradloc_agent_retention_deleted_total."""
from __future__ import annotations

import time
from pathlib import Path

from gradloc.agent.core import AgentCore
from gradloc.store.retention import RetentionConfig
from gradloc.store.sqlite import IncidentStore
from tests.builders import step_summary


def test_retention_deletions_are_counted(tmp_path: Path) -> None:
    store = IncidentStore(tmp_path / "s.db", RetentionConfig(max_age_days=None, max_incidents=None, max_step_rows=2))
    core = AgentCore(store=store)
    now = time.time()
    store.put_steps([step_summary("j", 0, n, now) for n in range(5)])
    core._housekeeping(busy=False)  # the worker's idle pass (runs retention when due: at start)
    counters = {(c.key, c.labels): c.value for c in core.state.snapshot().counters}
    assert counters[("retention_deleted", ("steps_by_count",))] == 3
    assert [r.step for r in store.step_summaries("j")] == [3, 4]
    store.close()
