"""A trainer in its own process streams to a real ingest server in this one. No mocks."""
from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.*` under plain `pytest` too
from tests.transport.factories import Receiver  # noqa: E402
from tests.transport.trainer_child import train_and_send  # noqa: E402

STEPS, JOB = 6, "cross-process"


def _expected_layers() -> set[str]:
    """The 'module' grouping of the same TinyGPT: one layer per module that owns parameters."""
    import torch

    from tests.helpers import tiny_gpt

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name.rsplit(".", 1)[0] for name, _ in tiny_gpt(0).named_parameters()}
    finally:
        torch.set_num_threads(n)


@pytest.mark.integration
def test_a_trainer_process_streams_its_steps_to_the_server():
    receiver = Receiver()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=train_and_send, args=(receiver.address, JOB, STEPS, out), daemon=True)
    child.start()
    try:
        report = out.get(timeout=180)
        child.join(30)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
        receiver.close()
    counts = report["counters"]
    assert report["sink_errors"] == 0
    assert (counts["sent_steps"], counts["queue_full"], counts["send_failed"], counts["rejected"],
            counts["encode_failed"]) == (STEPS, 0, 0, 0, 0)
    assert receiver.rejects == []
    steps = receiver.steps
    assert [s.step for s in steps] == list(range(STEPS))
    assert {(b.client.job, b.client.rank, b.client.world_size, b.client.pid) for b in receiver.batches} == {
        (JOB, 0, 1, report["pid"])}
    names = steps[0].layers.names
    assert set(names) == _expected_layers() and len(set(names)) == len(names)
    for s in steps:
        cols = s.layers
        assert (s.job, s.rank, s.micro_batches, s.nonfinite) == (JOB, 0, 2, 0) and cols.names == names
        assert np.isfinite(cols.grad_norm).all() and (cols.grad_norm > 0).all() and np.isfinite(s.global_norm)
        assert np.sqrt(np.sum(cols.grad_norm ** 2)) == pytest.approx(s.global_norm, rel=1e-4)
        assert (cols.numel > 0).all() and np.isfinite(cols.param_norm).all()
        assert s.loss is not None and np.isfinite(s.loss)
        assert s.tokens is not None and s.tokens.tokens == 2 * 4 * 16 and s.tokens.top
    ratios = np.stack([s.layers.update_ratio for s in steps])  # (steps, layers)
    # update_ratio=True ("lean"): a quarter of the parameters a step, so each step carries the layers its window
    # covered and every layer arrives within a sweep of 4 steps; none unknown is sent as a value
    measured = np.isfinite(ratios)
    assert measured.any(axis=1).all() and measured[:4].any(axis=0).all() and (ratios[measured] > 0).all()
