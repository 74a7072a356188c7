"""The origin of a *packed* sample — one training row cut from several documents (Megatron's GPTDataset) — and
the resolver that tells which one document a gradloc position lies in.

A packed row is one gradloc sample, so it has one :class:`~gradloc.records.SampleInfo` and one origin; the
origin lists the row's documents with the token where each begins, so that a culprit span can be traced to the
document it came from. The grammar (docs/provenance.md)::

    ORIGIN := WHERE " docs " PART ("," PART)*
    PART   := DOC ["+" SKIP] "@" START      a document's tokens in the row
            | "…" COUNT "@" START           COUNT documents left out (the origin's length limit)

``WHERE`` names the indexed dataset (Megatron: its path prefix), ``DOC`` is the document's index in it, ``SKIP``
the document's tokens before the row's part (only the first part has them: a row may begin inside a document),
``START`` the index in the row of the part's first token. Example:
``/data/web_text_document docs 16+2@0,0@2,15@12`` — tokens 0–1 are tokens 2–3 of document 16, tokens 2–11
document 0, tokens from 12 on document 15.

The origin is at most :data:`~gradloc.records.provenance.MAX_ORIGIN` characters: a row packed from very many
documents keeps its first documents and its last one, and the ones between become one ``…COUNT@START`` part; a
longer ``WHERE`` keeps its last characters. Positions inside the left-out run resolve to no document (None).
Pure Python: the agent renders incidents with it.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from gradloc.records.provenance import MAX_ORIGIN, SampleInfo

MAX_WHERE = 200  # characters of WHERE kept (its tail) — the documents need the rest of the origin
_SEP = " docs "
_DOC = re.compile(r"(\d+)(?:\+(\d+))?@(\d+)")
_GAP = re.compile(r"…(\d+)@(\d+)")


@dataclass(frozen=True)
class DocumentAt:
    """Where a position of a packed row comes from: ``document`` of the dataset ``where``, its token ``token``;
    ``part``: the document's place among the row's (0: the first)."""

    where: str
    document: int
    token: int
    part: int


def packed_origin(where: str, parts: Sequence[tuple[int, int, int]]) -> str:
    """The origin of a row packed from ``parts``: (document, skip, start) per document, in row order (the module
    docstring's grammar); never longer than MAX_ORIGIN — very many documents degrade to the first ones, a
    ``…COUNT@START`` run and the last one."""
    where = where if len(where) <= MAX_WHERE else "…" + where[-(MAX_WHERE - 1):]
    texts = [f"{d}+{s}@{a}" if s else f"{d}@{a}" for d, s, a in parts]
    head = f"{where}{_SEP}"
    full = head + ",".join(texts)
    if len(full) <= MAX_ORIGIN or len(texts) < 3:
        return full[:MAX_ORIGIN]
    last = texts[-1]
    used, k = len(head) + len(last), 0  # keep texts[:k], then the gap over texts[k:-1], then the last one
    while k < len(texts) - 2:
        gap = f"…{len(texts) - 2 - k}@{parts[k + 1][2]}"  # the gap if texts[k] is kept too
        if used + len(texts[k]) + 1 + len(gap) + 1 > MAX_ORIGIN:
            break
        used += len(texts[k]) + 1
        k += 1
    gap = f"…{len(texts) - 1 - k}@{parts[k][2]}"
    return head + ",".join([*texts[:k], gap, last])


def document_at(origin: str | SampleInfo | None, position: int) -> DocumentAt | None:
    """The document the token scored at gradloc ``position`` of a packed row comes from (position p scores token
    p + 1 of the row); None when ``origin`` is not a packed origin or the token is in a left-out run."""
    parsed = _parse(origin.origin if isinstance(origin, SampleInfo) else origin)
    if parsed is None:
        return None
    where, parts = parsed
    token = position + 1
    at, place = -1, 0  # the part holding the token, and its document's place in the row
    for i, (doc, n, start) in enumerate(parts):  # (document, skip) or (None, count) of a left-out run
        if start > token:
            break
        if at >= 0:
            place += parts[at][1] if parts[at][0] is None else 1
        at = i
    if at < 0 or parts[at][0] is None:
        return None
    doc, skip, start = parts[at]
    return DocumentAt(where, doc, skip + token - start, place)


def span_documents(origin: str | SampleInfo | None, start: int, end: int) -> str | None:
    """Positions ``[start, end)`` of a packed row in words: "document 15, its tokens 4–7" or "documents 0 → 15
    (the span crosses a boundary)"; None when the origin is not a packed one or a position is unknown."""
    first, last = document_at(origin, start), document_at(origin, max(start, end - 1))
    if first is None or last is None:
        return None
    if first.part != last.part:
        return f"documents {first.document} → {last.document} (the span crosses a document boundary)"
    tokens = f"token {first.token}" if first.token == last.token else f"tokens {first.token}–{last.token}"
    return f"document {first.document}, its {tokens}"


def _parse(origin: str | None) -> tuple[str, list[tuple[int | None, int, int]]] | None:
    if not origin or _SEP not in origin:
        return None
    where, body = origin.rsplit(_SEP, 1)
    parts: list[tuple[int | None, int, int]] = []
    for text in body.split(","):
        doc, gap = _DOC.fullmatch(text), _GAP.fullmatch(text)
        if doc is not None:
            parts.append((int(doc[1]), int(doc[2] or 0), int(doc[3])))
        elif gap is not None:
            parts.append((None, int(gap[1]), int(gap[2])))
        else:
            return None
    if any(b[2] <= a[2] for a, b in zip(parts, parts[1:])):
        return None  # starts must increase: not an origin this module wrote
    return where, parts


__all__ = ["DocumentAt", "MAX_WHERE", "document_at", "packed_origin", "span_documents"]
