"""The real-verl tier's split between the two environments.

``tests/verl_tier/inside/`` imports verl and runs only in ``.venv-verl``; the main venv must not collect it
(an import error there would fail the whole run), so it is ignored unless the running interpreter has verl
installed. ``test_verl_tier.py`` runs it from the main venv through that interpreter. The ``verl`` marker (the
bridge test carries it) is registered here: ``-m "not verl"`` deselects the tier.
"""
from __future__ import annotations

from tests.verl_tier._env import HAS_VERL

collect_ignore = [] if HAS_VERL else ["inside"]


def pytest_configure(config):
    config.addinivalue_line("markers", "verl: the real-verl tier (runs in .venv-verl, built by scripts/setup_verl.sh)")
