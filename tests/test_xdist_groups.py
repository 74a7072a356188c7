"""tests/conftest.py's xdist groups: the README's test command (``-n 2 --dist loadgroup``) runs the tests that start
processes one at a time, and a pytest whose node ids xdist cannot rename fails every test with the reason."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import conftest

ROOT = Path(__file__).resolve().parent


def _inner_suite(tmp_path: Path) -> Path:
    """A copy of the suite's conftest beside three test modules: one process test by marker, one by folder, two
    in-process tests of one module."""
    tests = tmp_path / "tests"
    (tests / "demo").mkdir(parents=True)
    shutil.copy(ROOT / "conftest.py", tests / "conftest.py")
    for init in (tests / "__init__.py", tests / "demo" / "__init__.py"):
        init.write_text("")
    (tests / "test_plain.py").write_text(
        "import pytest\n\n"
        "def test_one():\n    pass\n\n"
        "def test_two():\n    pass\n\n"
        "@pytest.mark.wallclock\ndef test_timed():\n    pass\n")
    (tests / "demo" / "test_demo.py").write_text("def test_runs_a_demo():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    wallclock: timed\n")
    return tmp_path


def test_loadgroup_puts_process_tests_in_one_group_and_modules_in_their_own(tmp_path: Path) -> None:
    root = _inner_suite(tmp_path)
    run = subprocess.run([sys.executable, "-m", "pytest", "-v", "-n", "2", "--dist", "loadgroup", "-p",
                          "no:cacheprovider", "tests"], cwd=root, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "4 passed" in run.stdout
    # xdist writes each test's group into its node id: the marker's and the folder's tests share `processes`
    assert "tests/test_plain.py::test_timed@processes" in run.stdout
    assert "tests/demo/test_demo.py::test_runs_a_demo@processes" in run.stdout
    assert "tests/test_plain.py::test_one@test_plain.py" in run.stdout
    assert "tests/test_plain.py::test_two@test_plain.py" in run.stdout


def _item(nodeid: str, config: object) -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, config=config)


def test_groups_that_did_not_take_fail_every_test_with_the_reason() -> None:
    """pytest 9.2 with xdist 3.8 (checked by hand: every test errors with this reason, rc 1; an exception raised in
    the worker's collection reached the user only as xdist's INTERNALERROR)."""
    config = SimpleNamespace(option=SimpleNamespace(loadgroup=True), stash=pytest.Stash())
    items = [_item("tests/test_plain.py::test_one", config), _item("tests/test_plain.py::test_two", config)]
    conftest.pytest_collection_finish(SimpleNamespace(config=config, items=items))
    with pytest.raises(pytest.fail.Exception, match="did not group the tests"):
        conftest.pytest_runtest_setup(items[0])


@pytest.mark.parametrize("loadgroup, nodeid", [(True, "tests/test_plain.py::test_one@test_plain.py"),
                                               (False, "tests/test_plain.py::test_one")])
def test_grouped_or_plain_runs_are_left_alone(loadgroup: bool, nodeid: str) -> None:
    config = SimpleNamespace(option=SimpleNamespace(loadgroup=loadgroup), stash=pytest.Stash())
    item = _item(nodeid, config)
    conftest.pytest_collection_finish(SimpleNamespace(config=config, items=[item]))
    conftest.pytest_runtest_setup(item)  # no failure
    assert conftest._UNGROUPED not in config.stash
