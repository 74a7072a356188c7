"""Fixtures of the real-vLLM tier: one tiny model directory and one in-process engine per session.

Runs only inside ``.venv-vllm`` (``tests/vllm_tier/conftest.py`` keeps the main venv from collecting this
directory). Measurements recorded by the tests are printed at the end of the session.
"""
from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest

import gradloc
from tests.vllm_tier.inside import engine

_MEASURED: dict[str, str] = {}


@pytest.fixture(scope="session")
def measured() -> dict[str, str]:
    """Named measurements (already formatted) printed in the terminal summary."""
    return _MEASURED


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return engine.build_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def llm(model_dir: Path, measured: dict[str, str]):
    t0 = time.perf_counter()
    llm = engine.start_engine(model_dir)
    measured["engine start (LLM(...) on the saved model)"] = f"{time.perf_counter() - t0:.2f} s"
    yield llm
    llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    return engine.PreTrainedTokenizerFast.from_pretrained(model_dir)


def pytest_terminal_summary(terminalreporter) -> None:
    if not _MEASURED:
        return
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    terminalreporter.section("vLLM tier measurements")
    for name, value in _MEASURED.items():
        terminalreporter.write_line(f"{name}: {value}")
    terminalreporter.write_line(f"peak RSS of the test process: {peak:.0f} MiB")
    # which checkout's gradloc ran: .venv-vllm has one installed editable, a worktree's PYTHONPATH shadows it
    terminalreporter.write_line(f"gradloc under test: {Path(gradloc.__file__).parent}")
