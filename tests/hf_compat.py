"""Import transformers in tests even where the installed torchvision cannot load.

The shared venv has torchvision 0.28.0 (a dependency of backpack-for-pytorch) whose compiled ops do not
load on torch 2.13.0+cpu (``RuntimeError: operator torchvision::nms does not exist``). transformers
imports torchvision from its image utilities whenever the package is findable, so importing any model
fails. Only when importing torchvision raises is it marked absent (``sys.modules["torchvision"] = None``
makes ``importlib.util.find_spec`` return None, as for an uninstalled package); a working torchvision
is left alone. No test here uses torchvision.
"""
from __future__ import annotations

import sys
from types import ModuleType


def import_transformers() -> ModuleType:
    if "torchvision" not in sys.modules:
        try:
            import torchvision  # noqa: F401
        except Exception:  # a build for another torch: unusable, and it would break transformers' import
            sys.modules["torchvision"] = None  # type: ignore[assignment]
    import transformers

    return transformers
