"""A real OTLP/gRPC receiver for tests: stores every metrics/trace export request it gets.

Built on the servicers ``opentelemetry-proto`` ships, served by grpcio on 127.0.0.1:0, so the
exporter under test talks to a real gRPC endpoint (no mocks). ``fail_with`` makes every call answer
that gRPC status instead (to test failure counting); ``delay_s`` makes every call slow (a backed-up
collector, to fill the exporter's queue).
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Self

import grpc
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import (
    trace_service_pb2,
    trace_service_pb2_grpc,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
from opentelemetry.proto.trace.v1.trace_pb2 import Span


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request, context):
        return self.receiver._store("metrics", request, context,
                                    metrics_service_pb2.ExportMetricsServiceResponse())


class _Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request, context):
        return self.receiver._store("traces", request, context, trace_service_pb2.ExportTraceServiceResponse())


class OtlpReceiver:
    def __init__(self, fail_with: grpc.StatusCode | None = None, delay_s: float = 0.0) -> None:
        self.fail_with, self.delay_s = fail_with, delay_s
        self.requests: dict[str, list] = {"metrics": [], "traces": []}
        self.calls = 0
        self._cond = threading.Condition()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_Metrics(self), self._server)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Traces(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)

    def _store(self, signal: str, request, context, response):
        time.sleep(self.delay_s)
        with self._cond:
            self.calls += 1
            if self.fail_with is None:
                self.requests[signal].append(request)
            self._cond.notify_all()
        if self.fail_with is not None:
            context.abort(self.fail_with, "test receiver refuses")
        return response

    def wait_for(self, predicate: Callable[[OtlpReceiver], bool], timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    # -- views of what arrived ------------------------------------------------------------------
    def metrics(self) -> dict[str, list[Metric]]:
        """Every received metric by name, oldest export first."""
        out: dict[str, list[Metric]] = {}
        with self._cond:
            requests = list(self.requests["metrics"])
        for req in requests:
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        out.setdefault(m.name, []).append(m)
        return out

    def latest(self, name: str) -> Metric:
        return self.metrics()[name][-1]

    def spans(self) -> list[Span]:
        with self._cond:
            requests = list(self.requests["traces"])
        return [s for req in requests for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]

    def resources(self, signal: str) -> list[dict]:
        with self._cond:
            requests = list(self.requests[signal])
        res = []
        for req in requests:
            for r in (req.resource_metrics if signal == "metrics" else req.resource_spans):
                res.append({kv.key: attr_value(kv.value) for kv in r.resource.attributes})
        return res


def attr_value(v):
    """A proto AnyValue as a Python value (lists for arrays)."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [attr_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def attrs(kvs) -> dict:
    return {kv.key: attr_value(kv.value) for kv in kvs}


def closed_port() -> int:
    """A localhost port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
