"""Suite-wide: the embedded incident store of every ``watch`` in the tests goes to a temp dir,
never to the developer's ``~/.local/state/gradloc``."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def _isolated_incident_db(tmp_path_factory: pytest.TempPathFactory):
    mp = pytest.MonkeyPatch()
    mp.setenv("GRADLOC_DB", str(tmp_path_factory.mktemp("gradloc-db") / "incidents.db"))
    yield
    mp.undo()
