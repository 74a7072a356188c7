"""DeepSpeed adapter setup, without DeepSpeed running: lazy import and typed refusals.

Stand-in engines here are plain objects with the attributes the check reads (the real engines are in
tests/distributed/test_deepspeed_grads.py); they cannot run a step.
"""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from gradloc.errors import UnsupportedModelError
from gradloc.parallel.zero import DeepSpeedGradAccess


def test_importing_the_adapter_does_not_import_deepspeed():
    code = "import sys, gradloc, gradloc.parallel.zero; assert 'deepspeed' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_not_an_engine_is_refused_with_a_typed_error():
    with pytest.raises(UnsupportedModelError, match="expected a deepspeed.DeepSpeedEngine"):
        DeepSpeedGradAccess(object())


def _engine(**kw):
    base = dict(module=None, optimizer=None, is_gradient_accumulation_boundary=lambda: True,
                zero_optimization_stage=lambda: 2, managed_gradient_accumulation=lambda: True,
                zero_offload_optimizer=lambda: None)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize("attrs, named", [
    (dict(pipeline_parallelism=True), "pipeline parallelism"),
    (dict(has_moe_layers=True), "MoE layers"),
    (dict(mpu=object()), "model/tensor parallelism"),
    (dict(sequence_parallel_size=2), "sequence parallelism"),
    (dict(zero_offload_optimizer=lambda: {"device": "cpu"}), "optimizer offload"),
    (dict(managed_gradient_accumulation=lambda: False), "managed_gradient_accumulation=false"),
])
def test_unverified_configurations_are_refused_by_name(attrs, named):
    with pytest.raises(UnsupportedModelError, match=named):
        DeepSpeedGradAccess(_engine(**attrs))


def test_an_offload_entry_whose_device_is_none_is_no_offload():
    """OpenRLHF writes offload_optimizer {"device": "none"} when nothing is offloaded: not refused (as DeepSpeed's
    own zero_cpu_offload() reads it); a real device is."""
    from gradloc.parallel.zero.grads import _offload

    assert not _offload(_engine(zero_offload_optimizer=lambda: {"device": "none"}))
    assert not _offload(_engine(zero_offload_optimizer=lambda: SimpleNamespace(device="none")))
    assert _offload(_engine(zero_offload_optimizer=lambda: SimpleNamespace(device="cpu")))
    assert not _offload(_engine())
