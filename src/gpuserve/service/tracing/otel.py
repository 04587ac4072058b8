"""OpenTelemetry traces (``--trace-config mode=opentelemetry``), with the official SDK.

Needs the ``tracing`` extra (``opentelemetry-sdk``, ``opentelemetry-exporter-otlp-proto-http``);
imported only when that mode is chosen, so a server without it pays nothing.

Per traced request, one span named after the model (kind SERVER for a client's request,
INTERNAL for an ensemble step or a BLS call, which nest under their request's span), with
the attributes ``model_name``, ``model_version``, ``request_id``, ``batch_size`` (rows of the
batch it ran in) and ``rows`` (its own), and four child spans: ``admission`` (decoding and
the model's admission step: tokenisation for text models), ``queue``, ``compute`` and
``response``. A failed request's span has status ERROR and the error's message. A client's
W3C ``traceparent`` (HTTP header, gRPC metadata) makes the request's span a child of the
client's: the trace continues.

Spans are exported over OTLP/HTTP (protobuf) by a batch span processor on its own thread;
Triton's ``opentelemetry,<setting>`` keys set it: ``url`` (default
``http://localhost:4318/v1/traces``; ``host:port/path`` gets ``http://``), ``resource``
(``key=value``, repeatable; ``service.name`` defaults to ``gpuserve``),
``bsp_max_queue_size`` (2048), ``bsp_schedule_delay`` (ms, 5000),
``bsp_max_export_batch_size`` (512) and ``bsp_export_timeout`` (ms, 3000: the longest one
export may take, its retries included, as OpenTelemetry's ``OTEL_BSP_EXPORT_TIMEOUT``).

At shutdown the spans still held are exported for at most ``bsp_export_timeout``: with a
collector that does not answer they are dropped (one warning says so) instead of holding
the server's exit for the exporter's retries.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from gpuserve.backends.optional import require
from gpuserve.engine.request import InferenceResponse
from gpuserve.service.tracing.traces import Traced, stage_stamps

logger = logging.getLogger(__name__)

DEFAULT_URL = "http://localhost:4318/v1/traces"


@dataclass(slots=True)
class OtelSettings:
    """Triton's ``--trace-config opentelemetry,<key>=<value>`` settings.

    Attributes:
        url: OTLP/HTTP traces endpoint.
        resource: Resource attributes (``service.name`` ...).
        bsp_max_queue_size: Spans held for export at most; more are dropped.
        bsp_schedule_delay_ms: Longest wait between two exports, milliseconds.
        bsp_max_export_batch_size: Spans per export at most (<= the queue size).
        bsp_export_timeout_ms: Longest one export may take, retries included, and longest
            the last export may take at shutdown, milliseconds.
    """

    url: str = DEFAULT_URL
    resource: dict[str, str] = field(default_factory=dict)
    bsp_max_queue_size: int = 2048
    bsp_schedule_delay_ms: int = 5000
    bsp_max_export_batch_size: int = 512
    bsp_export_timeout_ms: int = 3000


class OtelSink:
    """A tracer provider exporting to ``settings.url``; implements ``TraceSink``.

    Raises:
        MissingDependencyError: the ``tracing`` extra is not installed (the message says
            how to install it).
    """

    def __init__(self, settings: OtelSettings) -> None:
        needed = "--trace-config mode=opentelemetry"
        trace_api = require("opentelemetry.trace", needed)
        sdk = require("opentelemetry.sdk.trace", needed)
        export = require("opentelemetry.sdk.trace.export", needed)
        resources = require("opentelemetry.sdk.resources", needed)
        otlp = require("opentelemetry.exporter.otlp.proto.http.trace_exporter", needed)
        propagation = require("opentelemetry.trace.propagation.tracecontext", needed)
        url = settings.url if "://" in settings.url else f"http://{settings.url}"
        resource = resources.Resource.create({"service.name": "gpuserve", **settings.resource})
        self._export_timeout_s = settings.bsp_export_timeout_ms / 1000
        # Shut down by the server (bounded, see shutdown), not by an exit hook of its own.
        self._provider = sdk.TracerProvider(resource=resource, shutdown_on_exit=False)
        self._provider.add_span_processor(
            export.BatchSpanProcessor(
                otlp.OTLPSpanExporter(endpoint=url, timeout=self._export_timeout_s),
                max_queue_size=settings.bsp_max_queue_size,
                schedule_delay_millis=settings.bsp_schedule_delay_ms,
                max_export_batch_size=settings.bsp_max_export_batch_size,
                export_timeout_millis=settings.bsp_export_timeout_ms,
            )
        )
        self._tracer = self._provider.get_tracer("gpuserve")
        self._api = trace_api
        self._propagator = propagation.TraceContextTextMapPropagator()
        self._status = trace_api.Status
        self._error = trace_api.StatusCode.ERROR
        self.url = url
        logger.info("OpenTelemetry traces to %s", url)

    def open(self, trace: Traced, parent: Traced | None, traceparent: str | None) -> None:
        """Start the request's span (under ``parent``'s, or the client's context)."""
        context: Any = None
        if parent is not None and parent.handle is not None:
            context = self._api.set_span_in_context(parent.handle)
        elif traceparent:
            context = self._propagator.extract({"traceparent": traceparent})
        kind = self._api.SpanKind.SERVER if trace.kind == "request" else self._api.SpanKind.INTERNAL
        trace.handle = self._tracer.start_span(
            trace.model,
            context=context,
            kind=kind,
            start_time=trace.start_ns,
            attributes={
                "model_name": trace.model,
                "model_version": trace.version,
                "request_id": trace.request_id,
                "gpuserve.kind": trace.kind,
            },
        )

    def close(self, trace: Traced, outcome: InferenceResponse | BaseException | None) -> None:
        """End the span; a response's stages become its children."""
        span = trace.handle
        if span is None:
            return
        end = trace.end_ns
        if isinstance(outcome, InferenceResponse):
            timing = outcome.timing
            span.set_attribute("model_version", outcome.model_version)
            span.set_attribute("batch_size", timing.batch_size or outcome.rows)
            span.set_attribute("rows", outcome.rows)
            if outcome.id:
                span.set_attribute("request_id", outcome.id)
            queue, compute, computed = stage_stamps(trace.start_ns, end, timing)
            context = self._api.set_span_in_context(span)
            stages = ("queue", "compute")
            if timing.tokens is not None:  # a generated sequence: OpenTelemetry's GenAI names
                stages = ("prefill", "decode")
                span.set_attribute("gen_ai.usage.input_tokens", timing.tokens[0])
                span.set_attribute("gen_ai.usage.output_tokens", timing.tokens[1])
            for name, start, stop in (
                ("admission", trace.start_ns, queue),
                (stages[0], queue, compute),
                (stages[1], compute, computed),
                ("response", computed, end),
            ):
                child = self._tracer.start_span(name, context=context, start_time=start)
                child.end(end_time=stop)
        else:
            message = "cancelled" if outcome is None else str(outcome)
            span.set_status(self._status(self._error, message))
        span.end(end_time=end)

    def shutdown(self) -> None:
        """Export what is buffered and stop, waiting at most ``bsp_export_timeout`` (past
        it, the spans still held are dropped: the exporter's threads are daemons and never
        hold the process's exit)."""
        stopping = threading.Thread(
            target=self._provider.shutdown, name="gpuserve-otel-shutdown", daemon=True
        )
        stopping.start()
        stopping.join(self._export_timeout_s)
        if stopping.is_alive():
            logger.warning(
                "OpenTelemetry: the collector at %s took no spans within %.1f s "
                "(bsp_export_timeout); the spans still held are dropped",
                self.url,
                self._export_timeout_s,
            )
