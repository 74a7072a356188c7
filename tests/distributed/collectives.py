"""Count the torch.distributed collectives a process issues (test helper).

:func:`install` wraps every collective and point-to-point function of ``torch.distributed`` (the module
attributes, and the same names in ``distributed_c10d`` where c10d's own functions look them up). It
must run before ``deepspeed`` is imported: DeepSpeed's comm backend keeps references to some of them
(``all_gather_into_tensor``, ``reduce_scatter_tensor``) from its first initialisation. Only the
outermost call counts, so a collective built on another (``all_gather_object``) counts once.
"""
from __future__ import annotations

import functools
import threading
from collections import Counter

NAMES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_single",
         "_all_gather_base", "all_gather_coalesced", "all_gather_object", "gather", "gather_object", "reduce",
         "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "broadcast",
         "broadcast_object_list", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single", "barrier",
         "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "_broadcast_coalesced")

COUNTS: Counter = Counter()
_depth = threading.local()


def total() -> int:
    return sum(COUNTS.values())


def install() -> Counter:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in NAMES:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "_gradloc_counted", False):
            continue
        wrapped = _wrap(name, fn)
        setattr(dist, name, wrapped)
        if getattr(c10d, name, None) is fn:
            setattr(c10d, name, wrapped)
    return COUNTS


def _wrap(name, fn):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
        outer = not getattr(_depth, "n", 0)
        if outer:
            COUNTS[name] += 1
        _depth.n = getattr(_depth, "n", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _depth.n -= 1

    counted._gradloc_counted = True
    return counted
