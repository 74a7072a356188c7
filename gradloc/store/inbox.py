"""The store's inbox: rank incidents committed before the daemon acknowledges them.

An incident reaches the ``incidents`` table only after the correlator closes it (every rank's step
seen, or the straggler deadline), which can be seconds after it arrived. Acknowledging a batch
before then lost every incident in flight when the daemon died (issue 11: 2,579 acknowledged, 2,579
lost over 10 ``kill -9`` cycles). So the ingest path first commits each incident of a batch here,
keyed by the sending client's id, the batch's sequence number and the incident's position in it,
and acknowledges after that commit:

- a batch the client re-sends (its acknowledgement was lost) inserts nothing new: ``ON CONFLICT DO
  NOTHING`` on the key, and the daemon does not feed the duplicates to the correlator again;
- the correlated incident and the ``done`` flags of the inbox rows it holds commit in one
  transaction (``IncidentStore.put_incident(..., inbox_keys)``);
- at start-up, rows not ``done`` are fed to the correlator again (``pending``), so an incident
  acknowledged before a crash is stored after the restart. Each row has an ``owner``: ``daemon``
  (one daemon per store file), ``daemon:<host>:<ingest address>`` (one of the daemons sharing a
  PostgreSQL store: gradloc/agent/daemon.py), or an embedded agent (``embedded:<host>:<pid>:<uuid>``); an embedded
  agent starting on a host takes over (``claim``) the open rows of embedded agents on that host
  whose process is gone, so two live training processes sharing the default store never replay
  each other's incidents;
- ``done`` rows are kept for :data:`KEEP_DONE_S` to recognise late re-sends, then pruned with the
  retention pass.

Durability: on SQLite, WAL with ``synchronous=NORMAL``: a committed row survives the process being
killed; a power cut can lose the last commits (never corrupt the file). On PostgreSQL, a commit the
server acknowledged (``synchronous_commit`` on, its default) survives the daemon and the server.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from gradloc.store.backends import Connection

KEEP_DONE_S = 86_400.0
Key = tuple[str, int, int]  # (client id, batch sequence, position in the batch)

DDL = """
CREATE TABLE inbox (
    client_id     TEXT NOT NULL,
    sequence      INTEGER NOT NULL,
    idx           INTEGER NOT NULL,
    job           TEXT NOT NULL,
    rank          INTEGER NOT NULL,
    world_size    INTEGER NOT NULL,
    received_unix REAL NOT NULL,
    payload       TEXT NOT NULL,
    owner         TEXT NOT NULL,
    done          INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (client_id, sequence, idx)
);
CREATE INDEX inbox_pending ON inbox (owner, received_unix) WHERE done = 0
"""


def create(conn: Connection) -> None:
    for statement in DDL.split(";"):
        if statement.strip():
            conn.execute(statement)


def put(conn: Connection, key: tuple[str, int], who: tuple[str, int, int],
        payloads: Sequence[tuple[int, str]], now: float, owner: str) -> list[int]:
    """Insert the batch's incidents, (position in the batch, payload) each; the positions that were
    new (a re-sent batch: none)."""
    client_id, sequence = key
    job, rank, world = who
    new = []
    for i, text in payloads:
        cur = conn.execute("INSERT INTO inbox (client_id, sequence, idx, job, rank, world_size, received_unix, "
                           "payload, owner) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                           (client_id, sequence, i, job, rank, world, now, text, owner))
        if cur.rowcount == 1:
            new.append(i)
    return new


def mark_done(conn: Connection, keys: Sequence[Key]) -> None:
    conn.executemany("UPDATE inbox SET done = 1 WHERE client_id = ? AND sequence = ? AND idx = ?", keys)


def pending(conn: Connection, owner: str) -> list[tuple[Key, tuple[str, int, int], str]]:
    """(key, (job, rank, world size), payload) of ``owner``'s rows not yet in a stored incident, oldest first."""
    rows = conn.execute("SELECT client_id, sequence, idx, job, rank, world_size, payload FROM inbox "
                        "WHERE done = 0 AND owner = ? ORDER BY received_unix, client_id, sequence, idx",
                        (owner,)).fetchall()
    return [((c, s, i), (j, r, w), p) for c, s, i, j, r, w, p in rows]


def claim(conn: Connection, me: str, prefix: str, dead: Callable[[str], bool]) -> int:
    """Take over the open rows of owners starting with ``prefix`` for which ``dead(owner)``: an
    embedded agent whose training process was killed leaves its rows to the next one on the host."""
    owners = [o for (o,) in conn.execute("SELECT DISTINCT owner FROM inbox WHERE done = 0 AND owner >= ? AND "
                                         "owner < ?", (prefix, prefix + "\U0010ffff")) if o != me and dead(o)]
    n = 0
    for o in owners:
        n += conn.execute("UPDATE inbox SET owner = ? WHERE done = 0 AND owner = ?", (me, o)).rowcount
    return n


def prune(conn: Connection, now: float) -> int:
    return conn.execute("DELETE FROM inbox WHERE done = 1 AND received_unix < ?", (now - KEEP_DONE_S,)).rowcount
