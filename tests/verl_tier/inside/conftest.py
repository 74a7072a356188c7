"""Fixtures of the real-verl tier (runs only inside ``.venv-verl``: tests/verl_tier/conftest.py keeps the main
venv from collecting this directory): one tiny random Qwen2 checkpoint per session."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.verl_tier.inside.verl_job import save_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_model(str(Path(tmp_path_factory.mktemp("tiny-qwen2"))))
