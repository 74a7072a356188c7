"""Suite-wide settings.

- The embedded incident store of every ``watch`` in the tests goes to a temp dir, never to the
  developer's ``~/.local/state/gradloc``.
- A real PostgreSQL server (tests/postgres.py) is started once per session, on the first test that asks
  for ``pg_url`` (a fresh empty database per test, dropped after it), and stopped at the end.
- Every process the tests start runs torch on one intra-op thread (``OMP_NUM_THREADS=1``): with two
  OpenMP threads on a busy 2-core machine, spinning barriers made subprocess runs 10–50× slower
  (a demo that takes 15 s hit a 300 s timeout). In-process tests set it per test (tests/helpers.py).
- Under pytest-xdist (the README's test command: ``-n 2 --dist loadgroup``) every test gets a group: the tests
  that start processes of their own or assert a wall-clock bound (the ``PROCESSES_*`` lists below) share one group: they
  run one at a time as they always did, beside at most one in-process test; every other test is grouped with
  its module, whose module-scoped fixtures are then built once.
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Tests that must never run beside one another under xdist: those that start processes (ranks, daemons, servers,
# benchmarks, a browser, another test environment) and those that assert a wall-clock bound.
PROCESSES_MARKERS = ("distributed", "integration", "defaults", "browser", "vllm", "wallclock")
PROCESSES_PATHS = ("bench/test_bench_smoke.py", "bench/test_healthy.py", "bench/test_patterns.py",  # run `-m bench`
                   "test_xdist_groups.py",  # runs pytest with two workers
                   "distributed/", "integrations/distributed/", "defaults/", "demo/", "system/", "reliability/",
                   "verl_tier/", "vllm_tier/")  # by path: these folders' conftests mark their tests after this hook
PROCESSES_FIXTURES = ("ds_shm_op",)


def xdist_group(item: pytest.Item) -> str:
    """The xdist group of ``item``: ``processes`` (see above) or its module's path."""
    rel = os.path.relpath(str(item.fspath), os.path.dirname(__file__)).replace(os.sep, "/")
    if (any(item.get_closest_marker(m) for m in PROCESSES_MARKERS)
            or rel.startswith(PROCESSES_PATHS)
            or any(f in getattr(item, "fixturenames", ()) for f in PROCESSES_FIXTURES)):
        return "processes"
    return rel


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.pluginmanager.hasplugin("xdist"):  # the tier environments run without it
        return
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group(item)))


_UNGROUPED = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)  # after xdist's hook, which puts each test's group into its node id
def pytest_collection_finish(session: pytest.Session) -> None:
    """Under ``--dist loadgroup`` the groups must have taken: a pytest whose node ids xdist cannot rename (pytest 9.2
    with xdist 3.8: constraints.txt pins pytest below it) would run the process tests beside one another. Every test
    then fails in its set-up with the reason (:func:`pytest_runtest_setup`): an error raised here, in a worker, reaches
    the user only as xdist's INTERNALERROR about a crashed item (seen with pytest 9.2.0), without it."""
    config = session.config
    if session.items and getattr(config.option, "loadgroup", False) and not any("@" in i.nodeid for i in session.items):
        config.stash[_UNGROUPED] = ("pytest-xdist's --dist loadgroup did not group the tests (no '@group' in their "
                                    f"node ids; pytest {pytest.__version__}): see constraints.txt")


def pytest_runtest_setup(item: pytest.Item) -> None:
    reason = item.config.stash.get(_UNGROUPED, None)
    if reason:
        pytest.fail(reason, pytrace=False)


@pytest.fixture(autouse=True, scope="session")
def _isolated_incident_db(tmp_path_factory: pytest.TempPathFactory):
    mp = pytest.MonkeyPatch()
    mp.setenv("GRADLOC_DB", str(tmp_path_factory.mktemp("gradloc-db") / "incidents.db"))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def pg_server():
    from tests.postgres import running_server

    with running_server() as server:
        yield server


@pytest.fixture
def pg_url(pg_server):
    """A new empty database on the session's PostgreSQL server (CREATE DATABASE: milliseconds), dropped after."""
    name = pg_server.database()
    yield pg_server.url(name)
    pg_server.admin(f"DROP DATABASE {name} WITH (FORCE)")
