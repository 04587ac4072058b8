"""Triton's trace-setting and log-setting extensions, mapped onto what gpuserve has.

**Trace settings** (``/v2/trace/setting``, ``/v2/models/{m}/trace/setting``, gRPC
``TraceSetting``) use Triton's keys and string values: ``trace_level`` (``OFF`` or
``TIMESTAMPS``; ``TENSORS`` is refused: gpuserve does not copy tensors into traces),
``trace_rate`` (trace one request in N), ``trace_count`` (stop after N traces; ``-1``: never),
``log_frequency`` (flush the file every N traces; ``0``: at each trace), ``trace_file`` (a
file in the server's trace directory, ``--trace-dir``: a relative name goes there, any other
place is refused) and ``trace_mode`` (``triton`` or ``opentelemetry``, chosen at start-up by
``--trace-config mode=...`` and only read here). A model's settings override the
server-wide ones key by key; setting a model key to no value (JSON ``null``, an empty gRPC
list) clears it back to the server-wide value.

The settings choose which requests are traced (:meth:`TraceSettings.start`, at admission);
:mod:`gpuserve.service.tracing.traces` holds the traces and the two sinks: Triton's JSON lines in
``trace_file``, and OpenTelemetry spans (:mod:`gpuserve.service.tracing.otel`). Requests that are
not traced get no trace object; with tracing off the service does not even ask. Per-batch
profiles with ``torch.profiler`` stay on ``POST /v2/repository/models/{m}/trace``; NVTX
ranges are always on under CUDA.

**Log settings** (``/v2/logging``, gRPC ``LogSettings``): ``log_info``, ``log_warning``,
``log_error`` (booleans) and ``log_verbose_level`` (integer) set the level of the process's
root logger at run time (verbose > 0: DEBUG; else the lowest enabled of INFO, WARNING,
ERROR; none: CRITICAL); ``log_format`` is reported (``default``) and ``log_file`` must stay
``""`` (gpuserve logs to standard error).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpuserve.engine import tracing as engine_tracing
from gpuserve.errors import InvalidInputError
from gpuserve.service.tracing.otel import OtelSettings
from gpuserve.service.tracing.traces import JsonLinesSink, Traced, TraceSink, next_trace_id

logger = logging.getLogger(__name__)

TRACE_KEYS = (
    "trace_file",
    "trace_level",
    "trace_rate",
    "trace_count",
    "log_frequency",
    "trace_mode",
)
TRACE_LEVELS = ("OFF", "TIMESTAMPS")

#: Trace settings value: a list of strings (``trace_level``) or one string.
TraceValue = list[str] | str


def _default_trace() -> dict[str, TraceValue]:
    return {
        "trace_file": "",
        "trace_level": ["OFF"],
        "trace_rate": "1000",
        "trace_count": "-1",
        "log_frequency": "0",
        "trace_mode": "triton",
    }


def _check_trace(key: str, values: list[str], where: str, mode: str = "triton") -> TraceValue:
    """The stored value of ``key`` set to ``values`` (Triton's string lists)."""
    if key not in TRACE_KEYS:
        raise InvalidInputError(
            f"{where}: unknown trace setting {key!r}; expected one of {', '.join(TRACE_KEYS)}"
        )
    if key == "trace_level":
        levels = [value.upper() for value in values]
        bad = [level for level in levels if level not in (*TRACE_LEVELS, "TENSORS")]
        if bad or not levels:
            raise InvalidInputError(f"{where}: trace_level {values!r}: expected OFF or TIMESTAMPS")
        if "TENSORS" in levels:
            raise InvalidInputError(
                f"{where}: trace_level TENSORS is not supported by gpuserve (tensors are not "
                f"copied into traces); use TIMESTAMPS"
            )
        if "OFF" in levels and len(levels) > 1:
            raise InvalidInputError(f"{where}: trace_level OFF cannot be combined with others")
        return levels
    if len(values) != 1:
        raise InvalidInputError(f"{where}: {key} takes one value, got {values!r}")
    value = values[0]
    if key in ("trace_rate", "trace_count", "log_frequency"):
        try:
            number = int(value)
        except ValueError:
            number = None
        # rate 0 (only requests with a client's trace context) is Triton's, in OTel mode only
        rate_low = 0 if mode == "opentelemetry" else 1
        low = -1 if key == "trace_count" else (rate_low if key == "trace_rate" else 0)
        if number is None or number < low:
            raise InvalidInputError(f"{where}: {key} must be an integer >= {low}, got {value!r}")
        return str(number)
    if key == "trace_mode" and value != mode:
        raise InvalidInputError(
            f"{where}: trace_mode {value!r}: the mode is chosen at start-up "
            f"(--trace-config mode=triton|opentelemetry); this server runs only {mode!r}"
        )
    return value


@dataclass(slots=True)
class _Trace:
    """What the settings of one model mean for its requests."""

    rate: int  # trace one request in ``rate``; 0: only those with a client's trace context
    left: int  # traces still allowed; -1: unlimited
    sink: TraceSink
    seen: int = 0


class TraceSettings:
    """Triton's trace settings, server-wide and per model, and the sampler they drive.

    Args:
        trace_dir: The only folder trace files are written in (the server's ``trace_dir``):
            a relative ``trace_file`` is taken inside it, an absolute one must lie in it, so a
            client cannot make the server append to any other file. None: any path (tests).
        clock_ns: Wall clock, nanoseconds (injected for tests).
        mode: ``triton`` (JSON lines) or ``opentelemetry`` (spans through ``otel``); fixed
            for the server's life, as in Triton.
        otel: The exporter settings of the ``opentelemetry`` mode.
        initial: Server-wide settings to start with (``--trace-config``), Triton's keys.

    Raises:
        MissingDependencyError: ``opentelemetry`` mode without the ``tracing`` extra.
        InvalidInputError: a bad ``initial`` setting.
    """

    def __init__(
        self,
        trace_dir: Path | None = None,
        clock_ns: Callable[[], int] | None = None,
        mode: str = "triton",
        otel: OtelSettings | None = None,
        initial: dict[str, list[str]] | None = None,
    ) -> None:
        self.trace_dir = trace_dir
        self.mode = mode
        self._clock_ns = clock_ns or time.time_ns
        self._global = _default_trace()
        self._global["trace_mode"] = mode
        self._models: dict[str, dict[str, TraceValue]] = {}
        self._active: dict[str, _Trace] = {}  # model -> its sampler ("" = the server-wide one)
        #: Whether any request may be traced: a plain attribute, read on the request path
        #: (set with every change of the samplers).
        self.active = False
        self._lock = threading.Lock()
        self._otel: TraceSink | None = None
        if mode == "opentelemetry":
            from gpuserve.service.tracing.otel import OtelSink  # the tracing extra, only in this mode

            self._otel = OtelSink(otel or OtelSettings())
        if initial:
            self.update(dict(initial))

    def get(self, model: str | None = None) -> dict[str, TraceValue]:
        """The settings in effect for ``model`` (None: the server-wide ones)."""
        merged = dict(self._global)
        if model:
            merged.update(self._models.get(model, {}))
        return merged

    def update(
        self, changes: dict[str, list[str] | None], model: str | None = None
    ) -> dict[str, TraceValue]:
        """Apply ``changes`` (key -> values, None or ``[]``: clear a model's key, or reset a
        server-wide one to its default) and return the settings in effect.

        Raises:
            InvalidInputError: an unknown key or a bad value (nothing is changed then).
        """
        where = f"trace settings of model {model!r}" if model else "trace settings"
        staged = dict(self._models.get(model, {}) if model else self._global)
        defaults = _default_trace()
        defaults["trace_mode"] = self.mode
        for key, values in changes.items():
            if not values:
                if key not in TRACE_KEYS:
                    raise InvalidInputError(f"{where}: unknown trace setting {key!r}")
                if model:
                    staged.pop(key, None)
                else:
                    staged[key] = defaults[key]
                continue
            staged[key] = _check_trace(key, values, where, self.mode)
            if key == "trace_file":
                self._file_path(str(staged[key]), where)  # refused before anything changes
        with self._lock:
            if not model:
                self._global = staged
            elif staged:
                self._models[model] = staged
            else:  # every key cleared: the model follows the server-wide settings again
                self._models.pop(model, None)
            self._restart()
        return self.get(model)

    def _restart(self) -> None:
        """Rebuild the samplers from the settings (counts start again), under the lock."""
        for trace in self._active.values():
            if trace.sink is not self._otel:
                trace.sink.shutdown()
        self._active.clear()
        for name in ["", *self._models]:
            settings = self.get(name or None)
            if settings["trace_level"] == ["OFF"]:
                continue
            sink = self._otel
            if sink is None:
                path = str(settings["trace_file"])
                sink = JsonLinesSink(
                    self._file_path(path, "trace settings") if path else None,
                    int(str(settings["log_frequency"])),
                )
            self._active[name] = _Trace(
                rate=int(str(settings["trace_rate"])),
                left=int(str(settings["trace_count"])),
                sink=sink,
            )
        self.active = bool(self._active)
        engine_tracing.state.switch(self, self.active)

    def _file_path(self, given: str, where: str) -> Path:
        """Where ``trace_file`` ``given`` is written.

        Raises:
            InvalidInputError: outside the trace directory.
        """
        if self.trace_dir is None:
            return Path(given)
        root = self.trace_dir.resolve()
        path = (root / given).resolve()  # an absolute ``given`` replaces root
        if not path.is_relative_to(root) or path == root:
            raise InvalidInputError(
                f"{where}: trace_file {given!r} must be a file inside the server's trace "
                f"directory (--trace-dir); give a name relative to it"
            )
        return path

    def start(
        self,
        model: str,
        version: str | None,
        request_id: str | None,
        traceparent: str | None = None,
    ) -> Traced | None:
        """The trace of a request to ``model`` if its settings sample it, started now; else
        None. In ``opentelemetry`` mode a request carrying a client's ``traceparent`` is
        always traced (as in Triton), whatever the rate and count."""
        trace = self._active.get(model)
        if trace is None:
            if model in self._models:  # its own settings turn tracing off
                return None
            trace = self._active.get("")
            if trace is None:
                return None
        propagated = bool(traceparent) and trace.sink is self._otel
        with self._lock:
            trace.seen += 1
            if not propagated:
                if trace.left == 0 or trace.rate == 0 or (trace.seen - 1) % trace.rate:
                    return None
                if trace.left > 0:
                    trace.left -= 1
        traced = Traced(
            trace.sink,
            model,
            version or "",
            request_id or "",
            "request",
            self._clock_ns,
            next_trace_id(),
        )
        trace.sink.open(traced, None, traceparent if propagated else None)
        return traced

    def close(self) -> None:
        """Flush and close the trace files; export what the OpenTelemetry sink holds."""
        with self._lock:
            for trace in self._active.values():
                if trace.sink is not self._otel:
                    trace.sink.shutdown()
            if self._otel is not None:
                self._otel.shutdown()
                self._otel = None
            self._active.clear()
            self.active = False
            engine_tracing.state.switch(self, False)


#: Log settings value: bool, int or string.
LogValue = bool | int | str
LOG_KEYS = ("log_file", "log_info", "log_warning", "log_error", "log_verbose_level", "log_format")


class LogSettings:
    """Triton's log settings over the root logger's level.

    Args:
        root: The logger whose level is set (the root logger; another in tests).
    """

    def __init__(self, root: logging.Logger | None = None) -> None:
        self.root = root if root is not None else logging.getLogger()

    def get(self) -> dict[str, LogValue]:
        """The settings as the current level implies them."""
        level = self.root.getEffectiveLevel()
        return {
            "log_file": "",
            "log_info": level <= logging.INFO,
            "log_warning": level <= logging.WARNING,
            "log_error": level <= logging.ERROR,
            "log_verbose_level": 1 if level <= logging.DEBUG else 0,
            "log_format": "default",
        }

    def update(self, changes: dict[str, LogValue]) -> dict[str, LogValue]:
        """Apply ``changes`` and return the settings in effect.

        Raises:
            InvalidInputError: an unknown key, a value of the wrong type, a ``log_file``, or
                a ``log_format`` other than ``default`` (nothing is changed then).
        """
        current = self.get()
        for key, value in changes.items():
            if key not in LOG_KEYS:
                raise InvalidInputError(
                    f"unknown log setting {key!r}; expected one of {', '.join(LOG_KEYS)}"
                )
            want: type = type(current[key])
            if type(value) is not want:
                raise InvalidInputError(
                    f"log setting {key!r} must be a {want.__name__}, got {value!r}"
                )
            if key == "log_file" and value:
                raise InvalidInputError(
                    "log setting 'log_file': gpuserve logs to standard error; redirect it "
                    'instead (only "" is accepted)'
                )
            if key == "log_format" and value != "default":
                raise InvalidInputError(
                    f"log setting 'log_format': only 'default' is supported at run time, got "
                    f"{value!r} (start the server with --log-format json for JSON lines)"
                )
            if key == "log_verbose_level" and (not isinstance(value, int) or value < 0):
                raise InvalidInputError(
                    f"log setting 'log_verbose_level' must be >= 0, got {value!r}"
                )
            current[key] = value
        if current["log_verbose_level"]:
            level = logging.DEBUG
        elif current["log_info"]:
            level = logging.INFO
        elif current["log_warning"]:
            level = logging.WARNING
        elif current["log_error"]:
            level = logging.ERROR
        else:
            level = logging.CRITICAL
        if level != self.root.level:
            logger.warning("log level set to %s", logging.getLevelName(level))
            self.root.setLevel(level)
        return self.get()
