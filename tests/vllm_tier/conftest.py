"""The real-vLLM tier's split between the two environments.

``tests/vllm_tier/inside/`` imports ``vllm`` and runs only in ``.venv-vllm``; the main venv must not even
collect it (an import error there would fail the whole run), so it is ignored unless the running
interpreter has vLLM installed. ``test_tier.py`` runs it from the main venv through that interpreter.
"""
from __future__ import annotations

from tests.vllm_tier._env import HAS_VLLM

collect_ignore = [] if HAS_VLLM else ["inside"]
