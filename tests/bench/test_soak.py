"""The soak's configuration: where its RSS windows sit (bench/soak.py)."""
from __future__ import annotations

import pytest

from bench.soak import SoakConfig


@pytest.mark.parametrize(("minutes", "warm"), [(10, 240.0), (20, 240.0), (5, 120.0), (1 / 3, 8.0)])
def test_warmup_window_starts_after_the_heap_fill(minutes, warm):
    """The first RSS window starts at 240 s (the heap fills until ~200-240 s at 5,000/s), or at 40% of
    a shorter run, so the two 10% windows never overlap."""
    cfg = SoakConfig(minutes=minutes)
    assert cfg.warmup_end_s == pytest.approx(warm)
    assert cfg.warmup_end_s + 0.1 * cfg.duration_s < 0.9 * cfg.duration_s


def test_negative_warmup_refused():
    with pytest.raises(ValueError, match="warmup_s"):
        SoakConfig(warmup_s=-1.0)
