"""Deterministic generator of malformed and extreme ``IngestBatch`` messages for the daemon fuzz test.

Everything starts from a handful of *valid* batches (steps with several layer tables, token
statistics and RL fields; incidents with culprits, spans, unicode token text, classifications,
remedies; a nonfinite-gradient event) and mutates one copy per message, with a seeded
:class:`random.Random` (no wall clock, no hypothesis database: the same seed gives the same bytes).

Byte level (on the serialized batch): bit flips, truncations, splices of two batches, and, on a
parsed wire tree (``wire_tree``) re-serialized with correct lengths: varint blow-ups (huge values,
overlong and over-long-invalid encodings, length prefixes beyond the buffer), repeated fields (a
field entry duplicated 2 to 5,000 times, sub-messages merged), wrong wire types and unknown fields.

Message level (on a ``pb.IngestBatch`` copy): wrong batch and incident schema versions; NaN/±inf
and extreme floats in any float field; negative and huge integers in any integer field; repeated
columns one longer or shorter; control characters, unicode, over-long and invalid UTF-8 strings in
any string field, token text preferred (invalid UTF-8 is patched into the bytes after serializing:
protobuf refuses to encode it).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

from gradloc.records import (
    RL_ADVANTAGE_BUCKETS,
    RL_LOG_RATIO_BUCKETS,
    Classification,
    Culprit,
    CulpritSpan,
    Evidence,
    LayerShare,
    Remedy,
    RLStats,
    SampleInfo,
    TokenRL,
    TokenScore,
    TokenStats,
)
from gradloc.transport.wire import pb
from tests.builders import incident_record, layer, step_record
from tests.reliability.wire_tree import Field, blow_up_varint, parse, serialize
from tests.transport.factories import client_info, encode

INF, NAN = float("inf"), float("nan")
UNICODE = ("блок.0.внимание", "层.1.前馈", "head🙂", "e\u0301tude", "\u05e9\u05dc\u05d5\u05dd", "\U0001f9ea")
TOKEN_TEXT = (" 你好", " 🙂🙂", "e\u0301", " \u05e9\u05dc\u05d5\u05dd", "\tindent\n", " Ω≈ç√")
CONTROL = ("\x00", "\x07\x08", "\x1b[2J\x1b[31m", "\r\n\r\n", "\u202e\u202d", "\ufeff", "\U0010ffff", "\x7f\x85",
           "a\x00b", "\ud7ff", "\u0300" * 50)
INVALID_UTF8 = (b"\xff\xfe\xfd", b"\xc0\xaf\x41", b"\xed\xa0\x80", b"\xf4\x90\x80", b"\x80\x80\x80", b"\xe2\x28\xa1")
MARK = "\ue000"  # 3 bytes in UTF-8, like every INVALID_UTF8 entry: the patch keeps every length prefix right
FLOATS = (NAN, INF, -INF, -0.0, 5e-324, 1.7976931348623157e308, -1.7976931348623157e308, 1e-300, -1.0)
INTS = {  # protobuf type -> extreme values in its range
    "int64": (-1, -(2 ** 63), 2 ** 63 - 1, 2 ** 31, 2 ** 32 + 1, 2 ** 53 + 1, 2 ** 62, 1 << 20, 0, -2),
    "uint64": (2 ** 64 - 1, 2 ** 63, 2 ** 63 - 1, 2 ** 32, 0, 1 << 40),
    "uint32": (2 ** 32 - 1, 2 ** 31, 65_536, 0),
}
_TYPES = {3: "int64", 4: "uint64", 13: "uint32", 1: "double", 9: "string", 8: "bool"}


@dataclass(frozen=True)
class Fuzzed:
    family: str
    data: bytes


def base_batches() -> list[pb.IngestBatch]:
    """The valid batches every mutation starts from (each decodes and is accepted as it is)."""
    big = tuple(layer(f"model.layers.{i}.{UNICODE[i % len(UNICODE)]}", 1.0 + i) for i in range(64))
    uni = tuple(layer(n, 0.5 + i) for i, n in enumerate(UNICODE))
    share = (LayerShare(UNICODE[0], 0.6), LayerShare("not.in.table", 0.4))
    top = tuple(TokenScore(micro_batch=0, sample=j, position=3 + j, score=2.0 / (j + 1), share=0.3 / (j + 1),
                           token_id=100 + j if j % 2 else None, sample_id=f"uid-{j}" if j != 1 else None, layers=share)
                for j in range(4))
    tokens = TokenStats(tokens=512, total_score=9.0, top=top, top_share=0.3, micro_batch_shares=(0.7, 0.3),
                        unattributed_share=0.05, dropped_calls=1)
    rl = RLStats(300, (0,) * (len(RL_LOG_RATIO_BUCKETS) - 1) + (290, 10), 1.5, 2.2, 0.03, 0.4, 0.1,
                 (5,) * (len(RL_ADVANTAGE_BUCKETS) + 1), -0.5, 1.1, 3.0, 2.4)
    info = SampleInfo("req-🙂", 1, 12, 12, 30, "length")
    cls = Classification("train_inference_mismatch", "|Δlogp| ≥ log 2 — ratio 3.1", (Evidence("log_ratio", 1.13),))
    cul = Culprit(0, 1, 5, 0.8, 0.7, 42, TOKEN_TEXT[0], "uid-1", share, TokenRL(-0.1, -3.2, -0.2, 2.0, 0.9, True, 1.5),
                  cls, info, 0)
    span = CulpritSpan(0, 1, 5, 8, 0.8, (42, 43, 44), "".join(TOKEN_TEXT[:3]), "before ✓", "\tafter\n", "uid-1",
                       info, 0)
    rich = incident_record(3, job="fuzz-b", rank=0, classification=cls,
                    remedy=Remedy("drop_culprits", True, 40.0, 3.0, "culprits removed"))
    rich = replace(rich, localization=replace(rich.localization, culprits=(cul,), spans=(span,) * 3))
    bad = incident_record(4, job="fuzz-a", rank=2)
    bad = replace(bad, spike=replace(bad.spike, kinds=("nonfinite_grad",), global_norm=INF),
                  top_layers=(layer("head", INF, nonfinite=3, grad_max_abs=NAN),))
    inf_step = step_record(4, job="fuzz-a", rank=2, nonfinite=5, global_norm=INF,
                    layers=(layer("embed", NAN, nonfinite=5), layer("head", 3.0)))
    specs = [  # (client job, rank, world size, steps, incidents)
        ("fuzz-a", 1, 4, [step_record(0, job="fuzz-a"), step_record(1, job="fuzz-a", layers=uni, tokens=tokens)], [incident_record(1)]),
        ("fuzz-b", 0, 2, [step_record(2, job="fuzz-b", rank=0, layers=big, tokens=tokens, rl=rl)], [rich]),
        ("fuzz-a", 2, 4, [inf_step], [bad]),
        ("fuzz-c", 0, 1, [step_record(i, job="fuzz-c", rank=0, layers=uni) for i in range(12)], []),
        ("fuzz-b", 1, 2, [], [replace(rich, rank=1), replace(incident_record(5), job="fuzz-b", rank=1, scope="job")]),
        ("fuzz-c", 0, 1, [step_record(20, job="fuzz-c", rank=0, loss=NAN, grad_scale=65536.0, skipped=True,
                               overhead_s=0.01, step_s=0.2, overhead=0.05, shed=("update_ratio",))], []),
    ]
    out = []
    for k, (job, rank, world, steps, incidents) in enumerate(specs):
        client = client_info(job=job, rank=rank, world_size=world, client_id=f"fuzz-client-{k}")
        msg, _ = encode(steps, [replace(i, job=job) if i.job == "job-a" else i for i in incidents], client=client)
        msg.drops.CopyFrom(pb.ClientDrops(queue_full=k, rejected=1))
        out.append(msg)
    return out


def numbered(base: pb.IngestBatch, n: int) -> pb.IngestBatch:
    """A copy of ``base`` with its own sequence, steps, incident ids and job names for message ``n``.

    Own job names: the daemon keeps the largest world size any client of a job declared, and every
    incident of the job then lists each rank it misses (ranks_expected, ranks_missing, note). One
    mutated batch declaring 39,704 ranks for a shared job made each later incident of it ~550 KB
    (1,669 of them, a 1.2 GB store) and the worker fell behind; per-message jobs keep that to the
    batch's own incidents (the behaviour itself is reported, not changed, by this test)."""
    msg = pb.IngestBatch()
    msg.CopyFrom(base)
    msg.sequence = 1_000 + n
    msg.client.job += f"#{n}"
    for s in msg.steps:
        s.step += 100 * n + 1_000
    for j, inc in enumerate(msg.incidents):
        inc.incident_id = f"{n:08d}{j:02d}".ljust(32, "f")
        inc.step += 100 * n + 1_000
        inc.job += f"#{n}"
    return msg


class Mutator:
    """``Mutator(seed, base_batches()).messages(n)``: ``n`` mutated messages, the families in round-robin."""

    def __init__(self, seed: int, bases: list[pb.IngestBatch]) -> None:
        self.rng, self.bases = random.Random(seed), bases
        self.families = {"bit_flip": self.bit_flip, "truncate": self.truncate, "splice": self.splice,
                         "varint": self.varint, "repeat": self.repeat, "wire_type": self.wire_type,
                         "schema_version": self.schema_version, "nonfinite": self.nonfinite,
                         "int_extreme": self.int_extreme, "length": self.length, "text": self.text,
                         "invalid_utf8": self.invalid_utf8}

    def messages(self, n: int, first: int = 0) -> list[Fuzzed]:
        names = list(self.families)
        out = []
        for i in range(first, first + n):
            family = names[i % len(names)]
            msg = numbered(self.rng.choice(self.bases), i)
            out.append(Fuzzed(family, self.families[family](msg, i)))
        return out

    # -- byte level ------------------------------------------------------------------------------
    def bit_flip(self, msg: pb.IngestBatch, i: int) -> bytes:
        data = bytearray(msg.SerializeToString())
        for _ in range(self.rng.choice((1, 1, 2, 3, 8))):
            data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
        return bytes(data)

    def truncate(self, msg: pb.IngestBatch, i: int) -> bytes:
        data = msg.SerializeToString()
        if self.rng.random() < 0.5:  # anywhere in the bytes
            return data[:self.rng.randrange(len(data))]
        tree = parse(data)  # at a field boundary of some (sub-)message: the framing stays right
        t, j = self.rng.choice(self._entries(tree))
        del t[j:]
        return serialize(tree)

    def splice(self, msg: pb.IngestBatch, i: int) -> bytes:
        other = numbered(self.rng.choice(self.bases), i + 1)
        a, b = msg.SerializeToString(), other.SerializeToString()
        if self.rng.random() < 0.5:  # bytes of one batch, then bytes of another
            return a[:self.rng.randrange(len(a) + 1)] + b[self.rng.randrange(len(b) + 1):]
        ta, tb = parse(a), parse(b)  # a field (sub-message) of one batch put into the other
        t, j = self.rng.choice(self._entries(ta))
        u, k = self.rng.choice(self._entries(tb))
        t[j:j + self.rng.randint(0, 1)] = u[k:k + self.rng.randint(1, 3)]
        return serialize(ta)

    def _entries(self, tree: list[Field]) -> list[tuple[list[Field], int]]:
        """(containing list, index) of every field entry in the tree, nested ones included."""
        out = []
        for j, f in enumerate(tree):
            out.append((tree, j))
            if isinstance(f.value, list):
                out += self._entries(f.value)
        return out

    def varint(self, msg: pb.IngestBatch, i: int) -> bytes:
        tree = parse(msg.SerializeToString())
        entries = [(t, j) for t, j in self._entries(tree) if t[j].wire_type in (0, 2)]
        for _ in range(self.rng.choice((1, 1, 2))):
            t, j = self.rng.choice(entries)
            t[j] = blow_up_varint(t[j], self.rng)
        return serialize(tree)

    def repeat(self, msg: pb.IngestBatch, i: int) -> bytes:
        tree = parse(msg.SerializeToString())
        t, j = self.rng.choice(self._entries(tree)) if self.rng.random() < 0.7 else (tree, self.rng.randrange(len(tree)))
        copies = self.rng.choice((1, 1, 2, 5, 200, 5_000))
        at = self.rng.choice((j + 1, len(t)))  # next to it, or last (a non-repeated sub-message then merges)
        f = t[j]
        if isinstance(f.value, list):  # serialize the sub-message once, not once per copy
            f = replace(f, value=serialize(f.value))
        t[at:at] = [f] * copies
        return serialize(tree)

    def wire_type(self, msg: pb.IngestBatch, i: int) -> bytes:
        tree = parse(msg.SerializeToString())
        t, j = self.rng.choice(self._entries(tree))
        if self.rng.random() < 0.3:  # an unknown field (must be skipped, not refused)
            t.insert(j, Field(self.rng.choice((99, 536_870_911, 15)), 2, b"\x01\x02"))
        else:
            wt = self.rng.choice([w for w in (0, 1, 2, 5, 3, 4, 6, 7) if w != t[j].wire_type])
            t[j] = replace(t[j], wire_type=wt)
        return serialize(tree)

    # -- message level ---------------------------------------------------------------------------
    def schema_version(self, msg: pb.IngestBatch, i: int) -> bytes:
        if msg.incidents and self.rng.random() < 0.5:
            self.rng.choice(msg.incidents).schema_version = self.rng.choice((0, 2, 3, -1, 2 ** 62))
        else:
            msg.schema_version = self.rng.choice((0, 2, 3, 255, 2 ** 32 - 1))
        return msg.SerializeToString()

    def _scalar(self, msg: pb.IngestBatch, kinds: tuple[str, ...], prefer: tuple[str, ...] = ()) -> tuple | None:
        leaves = [x for x in _leaves(msg) if _TYPES.get(x[1].type) in kinds]
        preferred = [x for x in leaves if x[1].name in prefer]
        pool = preferred if preferred and self.rng.random() < 0.5 else leaves
        return self.rng.choice(pool) if pool else None

    def _set(self, leaf: tuple, value: object) -> None:
        parent, fd, j = leaf
        if j is None:
            setattr(parent, fd.name, value)
            return
        column = getattr(parent, fd.name)
        if j < len(column):
            column[j] = value
        else:
            column.append(value)

    def nonfinite(self, msg: pb.IngestBatch, i: int) -> bytes:
        for _ in range(self.rng.choice((1, 1, 3))):
            leaf = self._scalar(msg, ("double",))
            if leaf is not None:
                self._set(leaf, self.rng.choice(FLOATS))
        return msg.SerializeToString()

    def int_extreme(self, msg: pb.IngestBatch, i: int) -> bytes:
        leaf = self._scalar(msg, ("int64", "uint64", "uint32"),
                            prefer=("world_size", "rank", "step", "sequence", "start", "end", "micro_batches",
                                    "tokens", "numel", "layer_count", "layer_index", "token_id", "pid"))
        if leaf is not None:
            self._set(leaf, self.rng.choice(INTS[_TYPES[leaf[1].type]]))
        return msg.SerializeToString()

    def length(self, msg: pb.IngestBatch, i: int) -> bytes:
        columns = [(p, fd) for p, fd, j in _leaves(msg) if fd.is_repeated and j == 0 and len(getattr(p, fd.name))]
        if columns:
            parent, fd = self.rng.choice(columns)
            column = getattr(parent, fd.name)
            if self.rng.random() < 0.5:
                del column[self.rng.randrange(len(column))]
            else:
                column.append(column[-1])
        return msg.SerializeToString()

    def _text(self) -> str:
        r = self.rng.random()
        if r < 0.15:
            return self.rng.choice(("", "x" * 1_025, "y" * 65_537, "🙂" * 1_024))
        return "".join(self.rng.choice(CONTROL + TOKEN_TEXT + UNICODE) for _ in range(self.rng.randint(1, 6)))

    _TOKEN_FIELDS = ("text", "context_before", "context_after", "extra_layers", "sample_id", "names")

    def text(self, msg: pb.IngestBatch, i: int) -> bytes:
        for _ in range(self.rng.choice((1, 2))):
            leaf = self._scalar(msg, ("string",), self._TOKEN_FIELDS)
            if leaf is not None:
                self._set(leaf, self._text())
        return msg.SerializeToString()

    def invalid_utf8(self, msg: pb.IngestBatch, i: int) -> bytes:
        leaf = self._scalar(msg, ("string",), self._TOKEN_FIELDS)
        if leaf is None:
            return msg.SerializeToString()
        self._set(leaf, "ok " + MARK * self.rng.randint(1, 3) + " text")
        data = msg.SerializeToString()
        assert data.count(MARK.encode()) >= 1
        return data.replace(MARK.encode(), self.rng.choice(INVALID_UTF8))


def _leaves(msg: object) -> list[tuple]:
    """(message, field descriptor, index or None) of every scalar field reachable in ``msg`` — set or
    not; a repeated field also lists one index past its end (appending there makes it longer)."""
    out: list[tuple] = []
    for fd in msg.DESCRIPTOR.fields:
        value = getattr(msg, fd.name)
        if fd.type == fd.TYPE_MESSAGE:
            subs = value if fd.is_repeated else ([value] if msg.HasField(fd.name) else [])
            for sub in subs:
                out += _leaves(sub)
        elif fd.is_repeated:
            out += [(msg, fd, j) for j in range(len(value) + 1)]
        else:
            out.append((msg, fd, None))
    return out
