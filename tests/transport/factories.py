"""Hypothesis strategies, wire helpers and a recording ingest server shared by the transport tests (the records
themselves: tests/builders.py).

The strategies cover what the codec must carry exactly: None next to 0.0, empty tuples, NaN where
the policy allows it (unknown update ratios, non-finite losses, nonfinite-gradient steps), layer
shares that name layers outside the step's table, and sample/token ids present or absent.
"""
from __future__ import annotations

import math
import threading
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import strategies as st

from gradloc.records import (
    MAX_ORIGIN,
    MAX_SOURCE,
    MAX_TAG,
    MAX_TAGS,
    RL_ADVANTAGE_BUCKETS,
    RL_LOG_RATIO_BUCKETS,
    Classification,
    ClassKind,
    Culprit,
    CulpritGroup,
    CulpritSpan,
    Evidence,
    Incident,
    LayerShare,
    LayerStats,
    Level,
    Localization,
    Method,
    Remedy,
    RLStats,
    SampleInfo,
    SampleShare,
    SpikeEvent,
    Status,
    StepRecord,
    TokenRL,
    TokenScore,
    TokenStats,
    to_dict,
)
from gradloc.records.events import MAX_EVENT_NAME, MONITOR_EVENTS
from gradloc.records.groups import MAX_GROUP_NAME, GroupTokens
from gradloc.records.precursors import (
    MAX_DRIVERS,
    MAX_PRECURSOR_LAYER,
    STATISTICS,
    PrecursorDriver,
    PrecursorFinding,
    PrecursorKind,
    PrecursorStat,
    Trend,
)
from gradloc.reports import StepSummary, summarize
from gradloc.transport.codec import BatchDecoder, DecodedBatch, LayerTables, encode_incident, encode_step
from gradloc.transport.server import start_ingest_server
from gradloc.transport.wire import INGEST_METHOD, pb
from tests.builders import JOB

WORLD = 4
NAN, INF = float("nan"), float("inf")

finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
anyfloat = st.floats(width=64)  # NaN and ±inf included
nonneg = st.floats(min_value=0, allow_nan=False, allow_infinity=False, width=64)
small_int = st.integers(0, 2**40)
name = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
opt_text = st.none() | st.text(max_size=20)


# -- hypothesis strategies -----------------------------------------------------------------------
def opt(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.none() | strategy


@st.composite
def layer_stats(draw: st.DrawFn, n: str) -> LayerStats:
    bad = draw(st.integers(0, 3)) if draw(st.booleans()) else 0  # a layer with non-finite gradients
    g = anyfloat if bad else finite
    ratio = draw(st.none() | (anyfloat if bad else st.floats(allow_infinity=False)))  # NaN = unknown
    return LayerStats(layer=n, grad_norm=draw(g), grad_max_abs=draw(g), nonfinite=bad, param_norm=draw(g),
                      numel=draw(small_int), update_ratio=ratio)


@st.composite
def token_stats(draw: st.DrawFn, names: list[str], event: bool) -> TokenStats:
    f = anyfloat if event else finite
    pool = names + draw(st.lists(name, max_size=3))  # some shares name layers outside the table
    shares = st.lists(st.builds(LayerShare, st.sampled_from(pool), f), max_size=4) if pool else st.just([])
    score = st.builds(TokenScore, micro_batch=small_int, sample=small_int, position=small_int, score=f, share=f,
                      token_id=opt(small_int), sample_id=opt_text, layers=shares.map(tuple))
    return TokenStats(tokens=draw(small_int), total_score=draw(f), top=tuple(draw(st.lists(score, max_size=5))),
                      top_share=draw(f), micro_batch_shares=tuple(draw(st.lists(f, max_size=4))),
                      unattributed_share=draw(f), dropped_calls=draw(small_int))


@st.composite
def rl_stats(draw: st.DrawFn) -> RLStats:
    counts = lambda n: st.one_of(st.just(()), st.lists(st.integers(0, 2**40), min_size=n, max_size=n).map(tuple))  # noqa: E731
    return RLStats(draw(small_int), draw(counts(len(RL_LOG_RATIO_BUCKETS) + 1)), *(draw(opt(finite)) for _ in range(5)),
                   draw(counts(len(RL_ADVANTAGE_BUCKETS) + 1)), *(draw(opt(finite)) for _ in range(4)),
                   kl_rollout=draw(opt(nonneg)), job_entropy_mean=draw(opt(finite)), job_kl_rollout=draw(opt(nonneg)))


_tag_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=MAX_TAG)
infos = st.builds(SampleInfo, opt_text, opt(small_int), small_int, small_int, small_int, opt_text,
                  source=opt(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1,
                                     max_size=MAX_SOURCE)),
                  origin=opt(st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1,
                                     max_size=MAX_ORIGIN)),
                  tags=st.dictionaries(_tag_text, _tag_text, max_size=MAX_TAGS).map(lambda d: tuple(sorted(d.items()))))


# the monitor's cumulative event counts: declared names, undeclared ones, sorted, non-zero (StepRecord.events)
events = st.dictionaries(st.sampled_from([*MONITOR_EVENTS][:6]) | st.text(min_size=1, max_size=MAX_EVENT_NAME),
                         st.integers(1, 2**62), max_size=5).map(lambda d: tuple(sorted(d.items())))

# the step's data groups (StepRecord.groups): valid kinds, names and counts
groups = st.lists(st.builds(GroupTokens, kind=st.sampled_from(["source", "tag", "length"]),
                            name=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1,
                                         max_size=MAX_GROUP_NAME),
                            samples=st.integers(0, 2**40), tokens=st.integers(0, 2**50)),
                  max_size=6).map(tuple)

# the step's precursor statistics (StepRecord.precursors): valid kinds, names, heads and locations, finite values
precursors = st.lists(st.builds(PrecursorStat, kind=st.sampled_from(list(PrecursorKind)),
                                layer=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)),
                                              max_size=MAX_PRECURSOR_LAYER),
                                value=finite, head=st.none() | st.integers(0, 2**20),
                                at=st.none() | st.tuples(*(st.integers(0, 2**30) for _ in range(3)))),
                      max_size=6).map(tuple)



@st.composite
def precursor_findings(draw: st.DrawFn, job: str, rank: int, step: int, time_unix: float) -> tuple[PrecursorFinding, ...]:
    """The drift detector's findings of one step (StepRecord.precursor_findings): the step's job, rank, step and time,
    valid statistics and trends, finite numbers (a change of +inf: a zero baseline), drifts starting at or before the
    step, drivers inside it, some with provenance."""
    driver = st.builds(PrecursorDriver, step=st.integers(0, step), value=finite, micro_batch=small_int, sample=small_int,
                       position=small_int, sample_id=opt_text, sample_info=opt(infos))
    finding = st.builds(PrecursorFinding, job=st.just(job), rank=st.just(rank), step=st.just(step),
                        time_unix=st.just(time_unix), statistic=st.sampled_from(STATISTICS),
                        layer=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40),
                        head=opt(st.integers(0, 2**20)), trend=st.sampled_from(list(Trend)), value=finite,
                        baseline=finite, z=finite, change=finite | st.just(INF), rate=finite,
                        since_step=st.integers(0, step), pages=st.booleans(),
                        drivers=st.lists(driver, max_size=MAX_DRIVERS).map(tuple), detail=st.text(max_size=40))
    return tuple(draw(st.lists(finding, max_size=3)))


# the detector's band: (None, None) during warm-up, else 0 <= mean <= threshold
bands = st.none().map(lambda _: (None, None)) | st.tuples(nonneg, nonneg).map(lambda p: (p[0], p[0] + p[1])).filter(
    lambda p: p[1] < float("inf"))


@st.composite
def step_records(draw: st.DrawFn) -> StepRecord:
    names = draw(st.lists(name, max_size=8, unique=True))
    layers = tuple(draw(layer_stats(n)) for n in names)
    nonfinite = sum(s.nonfinite for s in layers) + draw(st.integers(0, 2))
    event = nonfinite > 0
    tokens = draw(st.none() | token_stats(names, event))
    norm_mean, norm_threshold = draw(bands)
    overhead_s, step_s, overhead = (draw(opt(nonneg)) for _ in range(3))
    job, rank, step, time_unix = draw(st.sampled_from([JOB, "other-job"])), draw(st.integers(0, WORLD - 1)), \
        draw(small_int), draw(finite)
    return StepRecord(job=job, rank=rank, step=step, time_unix=time_unix, global_norm=draw(anyfloat if event else finite),
                      loss=draw(st.none() | anyfloat), micro_batches=draw(st.integers(0, 64)), layers=layers,
                      tokens=tokens, nonfinite=nonfinite, grad_scale=draw(st.none() | finite),
                      skipped=draw(st.booleans()), overhead_s=overhead_s, step_s=step_s, overhead=overhead,
                      shed=tuple(draw(st.lists(st.sampled_from(["update_ratio", "layer_breakdown"]), max_size=2,
                                               unique=True))),
                      rl=draw(opt(rl_stats())), layers_global=draw(st.booleans()), norm_mean=norm_mean,
                      norm_threshold=norm_threshold, events=draw(events), groups=draw(groups), precursors=draw(precursors),
                      precursor_findings=draw(precursor_findings(job, rank, step, time_unix)))


@st.composite
def incidents(draw: st.DrawFn) -> Incident:
    event = draw(st.booleans())
    kinds = ("nonfinite_grad",) if event else tuple(draw(st.lists(st.sampled_from(["grad_spike", "loss_spike"]))))
    g = anyfloat if event else finite
    derived = anyfloat if event else (finite | st.just(NAN))  # NaN = "could not be measured"
    loss = draw(opt(anyfloat))
    lossy = anyfloat if loss is not None and not math.isfinite(loss) else finite
    shares = st.lists(st.builds(LayerShare, name, derived), max_size=3).map(tuple)
    classes = st.builds(Classification, st.sampled_from(list(ClassKind)), st.text(max_size=20),
                        st.lists(st.builds(Evidence, name, derived), max_size=3).map(tuple))
    token_rl = st.builds(TokenRL, *([opt(derived)] * 5), opt(st.booleans()), opt(derived), opt(derived))
    culprits = st.lists(st.builds(Culprit, small_int, small_int, small_int, derived, derived, opt(small_int),
                                  opt_text, opt_text, shares, opt(token_rl), opt(classes), opt(infos),
                                  opt(st.integers(0, WORLD - 1))),
                        max_size=3).map(tuple)
    spans = st.lists(st.builds(lambda mb, s, a, d, sh, ids, t, ws, win: CulpritSpan(
        mb, s, a, a + d, sh, ids, *t, ws, tuple(x for x, _ in win), tuple(y for _, y in win)),
                               small_int, small_int, small_int, st.integers(0, 5), derived,
                               st.lists(small_int, max_size=3).map(tuple),
                               st.tuples(opt_text, opt_text, opt_text, opt_text, opt(infos), opt(st.integers(0, WORLD - 1))),
                               small_int, st.lists(st.tuples(st.text(max_size=8), derived), max_size=4)),
                     max_size=2).map(tuple)
    samples = st.lists(st.builds(SampleShare, small_int, small_int, derived, opt(derived), opt_text, small_int,
                                 opt(st.integers(0, WORLD - 1))), max_size=3).map(tuple)
    groups = st.lists(st.builds(CulpritGroup, share=derived, micro_batch=opt(small_int),
                                rank=opt(st.integers(0, WORLD - 1)), micro_batches=small_int, samples=small_int,
                                tokens=small_int), max_size=2).map(tuple)
    loc = draw(opt(st.builds(Localization, step=small_int, method=st.sampled_from(list(Method)),
                             status=st.sampled_from(list(Status)), level=st.sampled_from(list(Level)),
                             probes=small_int, passes=small_int, explained_share=opt(derived), global_norm=g,
                             culprit_norm=opt(derived), norm_without_culprits=opt(derived), culprits=culprits,
                             spans=spans, micro_batch_shares=st.lists(derived, max_size=3).map(tuple),
                             unattributed_share=derived, loss_share=opt(lossy), loss_without_culprits=opt(lossy),
                             note=st.text(max_size=30), samples=samples, groups=groups)))
    remedy = draw(opt(st.builds(Remedy, name, st.booleans(), g, opt(derived), st.text(max_size=30))))
    spike = SpikeEvent(step=draw(small_int), kinds=kinds, global_norm=draw(g), z=draw(opt(finite)),
                       mean=draw(opt(finite)), std=draw(opt(finite)), loss=loss, loss_z=draw(opt(finite)),
                       loss_mean=draw(opt(finite)), layers=tuple(draw(st.lists(name, max_size=3))),
                       detail=draw(st.text(max_size=30)), follows=draw(opt(small_int)),
                       last_healthy_step=draw(opt(small_int)))
    top = tuple(draw(st.lists(name.flatmap(layer_stats), max_size=3)))
    return Incident(incident_id=draw(name), job=draw(name), rank=draw(st.integers(0, WORLD - 1)), step=draw(small_int),
                    time_unix=draw(finite), spike=spike, localization=loc,
                    top_layers=top, remedy=remedy, classification=draw(opt(classes)),
                    scope=draw(st.sampled_from(["rank", "job"])))


# -- wire helpers ----------------------------------------------------------------------------------
def client_info(**kw: Any) -> pb.ClientInfo:
    args = dict(job=JOB, rank=1, world_size=WORLD, client_id="c0ffee", hostname="host", pid=123,
                gradloc_version="0.1.0")
    args.update(kw)
    return pb.ClientInfo(**args)


def encode(steps: list[StepRecord] = (), incidents: list[Incident] = (), *, tables: bool = True,
           client: pb.ClientInfo | None = None, schema_version: int = 1) -> tuple[pb.IngestBatch, list[pb.Step]]:
    """A batch message (as the client would build it) and its step messages, for editing in tests."""
    client = client or client_info()
    reg = LayerTables()
    header = pb.IngestBatch(schema_version=schema_version, client=client, sequence=1)
    msgs, seen = [], {}
    for rec in steps:
        names = tuple(s.layer for s in rec.layers)
        tid, index = reg.lookup(names)
        seen[tid] = names
        msgs.append(encode_step(rec, tid, index, client.job, client.rank))
    if tables:
        header.layer_tables.extend(pb.LayerTable(id=i, names=n) for i, n in seen.items())
    header.steps.extend(msgs)
    header.incidents.extend(encode_incident(i) for i in incidents)
    return header, list(header.steps)


def to_bytes(steps: list[StepRecord] = (), incidents: list[Incident] = (), **kw: Any) -> bytes:
    msg, _ = encode(steps, incidents, **kw)
    return msg.SerializeToString()


def assert_summary_equal(got: StepSummary, rec: StepRecord) -> None:
    """Column-wise equality with ``summarize(rec)`` (NaN equal to NaN)."""
    want = summarize(rec)
    for field in ("job", "rank", "step", "micro_batches", "nonfinite", "skipped"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.shed == want.shed
    assert to_dict(got)["rl"] == to_dict(want)["rl"] and got.layers_global == want.layers_global
    for field in ("time_unix", "global_norm", "loss", "grad_scale", "overhead_s", "step_s", "overhead", "norm_mean",
                  "norm_threshold"):
        a, b = getattr(got, field), getattr(want, field)
        assert (a is None) == (b is None) and (a is None or a == b or (math.isnan(a) and math.isnan(b))), field
    assert got.layers.names == want.layers.names
    for field in ("grad_norm", "grad_max_abs", "nonfinite", "param_norm", "numel", "update_ratio"):
        a, b = getattr(got.layers, field), getattr(want.layers, field)
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), field
        assert not a.flags.writeable
    assert (got.tokens is None) == (want.tokens is None)
    if want.tokens is not None:
        assert to_dict(got.tokens) == to_dict(want.tokens)  # (to_dict spells NaN "nan", so NaN == NaN)
    assert got.samples == want.samples  # per-sample findings: all finite, compared exactly
    assert got.events == rec.events and got.events_dropped == 0  # the monitor's event counts (a decoded step's)
    assert got.groups == rec.groups and got.groups_dropped == 0  # its data groups
    assert got.precursors == rec.precursors and got.precursors_dropped == 0  # its precursor statistics
    assert got.precursor_findings == rec.precursor_findings and got.precursor_findings_dropped == 0  # drift findings


class Receiver:
    """A real ingest server on 127.0.0.1 with a recording handler (``fail``: an exception it raises)
    and a raw-bytes channel to it."""

    def __init__(self, port: int = 0, max_message_bytes: int = 16 << 20) -> None:
        self.batches: list[DecodedBatch] = []
        self.rejects: list[str] = []
        self.fail: BaseException | None = None
        self.lock = threading.Lock()
        self.decoder = BatchDecoder(max_message_bytes=max_message_bytes)
        self.server, self.port = start_ingest_server(self.handle, self.reject, address=f"127.0.0.1:{port}",
                                                     max_message_bytes=max_message_bytes, workers=2,
                                                     decoder=self.decoder)
        self.address = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.address)
        self.call = self.channel.unary_unary(INGEST_METHOD)  # raw bytes in and out

    def handle(self, batch: DecodedBatch) -> None:
        if self.fail is not None:
            raise self.fail
        with self.lock:
            self.batches.append(batch)

    def reject(self, reason: str) -> None:
        with self.lock:
            self.rejects.append(reason)

    @property
    def steps(self) -> list[StepSummary]:
        with self.lock:
            return [s for b in self.batches for s in b.steps]

    def send(self, data: bytes) -> pb.IngestReply:
        return pb.IngestReply.FromString(self.call(data, timeout=10))

    def refused(self, data: bytes) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as info:
            self.call(data, timeout=10)
        return info.value

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0).wait(5)
