"""A CPU platform for verl 0.9.1, so that its own FSDP engine (``FSDPEngineWithLMHead``) runs on gloo.

verl resolves its device through ``verl.plugin.platform`` (``get_platform()``: the one ``set_platform``
chose, else ``VERL_PLATFORM`` or auto-detection among the registered classes: nvidia, huawei, amd). Every
device call of the FSDP engine — ``init_device_mesh(get_device_name(), ...)``,
``micro_batch.to(get_device_id())``, seeds, ``empty_cache``, the communication backend — goes through it. :func:`install_cpu_platform` registers ``"cpu"`` and makes it
the current platform: device "cpu", backend gloo, no-op memory and profiler calls. Nothing of verl is
patched; only its platform registry is extended, as an out-of-tree accelerator plugin would.
"""
from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any, Iterator, Optional

import torch

_INSTALLED = False


def install_cpu_platform() -> None:
    """Register the CPU platform and select it (call before verl's engine modules are used; once per process)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from verl.plugin.platform import PlatformBase, PlatformRegistry, set_platform

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = "cpu"  # type: ignore[assignment]  (a property in the base: a constant here)
        vendor_name = "cpu"  # type: ignore[assignment]

        @property
        def device_module(self) -> ModuleType:
            return torch.cpu

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return True

        def current_device(self) -> Any:
            return "cpu"  # used as micro_batch.to(get_device_id()) and tensor.to(...)

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: Any) -> None:
            pass

        def synchronize(self, device_index: Optional[int] = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CPU_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg: str) -> Iterator[None]:
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    set_platform(PlatformCPU())
    _INSTALLED = True
