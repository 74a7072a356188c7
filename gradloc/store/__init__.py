"""The agent's incident store: correlated incidents and step summaries, in SQLite or PostgreSQL (no torch import).

See ``docs/incident-store.md`` for the schema, the JSON shape and the ``gradloc-agent incidents`` CLI.
"""
from __future__ import annotations

from gradloc.store.errors import AmbiguousIdError, SchemaVersionError, StoreError
from gradloc.store.incident_json import correlated_from_dict, correlated_to_dict
from gradloc.store.retention import RetentionConfig
from gradloc.store.rows import IncidentRow, StepRow
from gradloc.store.schema import SCHEMA_VERSION
from gradloc.store.sqlite import IncidentStore, default_db_path

__all__ = ["SCHEMA_VERSION", "AmbiguousIdError", "IncidentRow", "IncidentStore", "RetentionConfig",
           "SchemaVersionError", "StepRow", "StoreError", "correlated_from_dict", "correlated_to_dict",
           "default_db_path"]
