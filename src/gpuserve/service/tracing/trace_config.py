"""Triton's ``--trace-config`` entries, read into the settings the tracer starts with.

=====================================  ==============================================
entry                                  meaning
=====================================  ==============================================
``rate=N``                             trace one request in N (``0`` in opentelemetry
                                       mode: only requests with a client's context)
``level=TIMESTAMPS|OFF``               tracing on or off (repeatable, as in Triton)
``count=N``                            stop after N traces (``-1``: never)
``mode=triton|opentelemetry``          JSON lines in a file, or OpenTelemetry spans
``triton,file=NAME``                   the trace file (inside ``--trace-dir``)
``triton,log-frequency=N``             flush the file every N traces
``opentelemetry,url=URL``              the OTLP/HTTP endpoint
``opentelemetry,resource=KEY=VALUE``   a resource attribute (repeatable)
``opentelemetry,bsp_max_queue_size=N`` the batch span processor's settings
``opentelemetry,bsp_schedule_delay=MS``
``opentelemetry,bsp_max_export_batch_size=N``
``opentelemetry,bsp_export_timeout=MS``   longest one export may take, retries included
                                       (also the bound of the last export at shutdown)
=====================================  ==============================================
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from gpuserve.errors import ConfigError
from gpuserve.service.tracing.otel import OtelSettings

_GLOBAL = {"rate": "trace_rate", "level": "trace_level", "count": "trace_count"}
_TRITON = {"file": "trace_file", "log-frequency": "log_frequency"}
_BSP = (
    "bsp_max_queue_size",
    "bsp_schedule_delay",
    "bsp_max_export_batch_size",
    "bsp_export_timeout",
)
MODES = ("triton", "opentelemetry")


@dataclass(slots=True)
class TraceStart:
    """What ``--trace-config`` asks for.

    Attributes:
        mode: ``triton`` or ``opentelemetry``.
        settings: Trace-setting keys (``trace_rate`` ...) -> Triton's value lists.
        otel: The OpenTelemetry exporter's settings.
    """

    mode: str = "triton"
    settings: dict[str, list[str]] = field(default_factory=dict)
    otel: OtelSettings = field(default_factory=OtelSettings)


def _bad(entry: str, expected: str) -> ConfigError:
    return ConfigError(f"--trace-config {entry!r}: expected {expected}")


def parse_trace_config(entries: Iterable[str]) -> TraceStart:
    """Read ``--trace-config`` entries (in order; a later one wins, ``level`` adds up).

    Raises:
        ConfigError: an unknown mode or setting, or a value that is not a number where
            one is expected; the message quotes the entry and what is allowed.
    """
    start = TraceStart()
    for entry in entries:
        scope, _, rest = entry.partition(",") if "," in entry.split("=", 1)[0] else ("", "", entry)
        key, eq, value = rest.partition("=")
        key = key.strip()
        if not eq or not key:
            raise _bad(entry, "<setting>=<value> or <mode>,<setting>=<value>")
        if scope == "":
            if key == "mode":
                if value not in MODES:
                    raise _bad(entry, "mode=triton or mode=opentelemetry")
                start.mode = value
            elif key in _GLOBAL:
                name = _GLOBAL[key]
                if name == "trace_level":
                    levels = start.settings.setdefault(name, [])
                    levels.append(value.upper())
                else:
                    start.settings[name] = [value]
            else:
                names = ", ".join([*_GLOBAL, "mode"])
                raise _bad(entry, f"one of {names} (or triton,<setting> / opentelemetry,<setting>)")
        elif scope == "triton":
            if key not in _TRITON:
                raise _bad(entry, f"triton,<{'|'.join(_TRITON)}>=<value>")
            start.settings[_TRITON[key]] = [value]
        elif scope == "opentelemetry":
            _otel_setting(start.otel, entry, key, value)
        else:
            raise _bad(entry, "a global setting, triton,<setting> or opentelemetry,<setting>")
    if start.otel.bsp_max_export_batch_size > start.otel.bsp_max_queue_size:
        raise ConfigError(
            f"--trace-config opentelemetry,bsp_max_export_batch_size="
            f"{start.otel.bsp_max_export_batch_size} must be <= bsp_max_queue_size="
            f"{start.otel.bsp_max_queue_size}"
        )
    chosen = start.settings.get("trace_level")
    if chosen and "OFF" in chosen and len(chosen) > 1:  # a later level replaces OFF
        start.settings["trace_level"] = [level for level in chosen if level != "OFF"]
    return start


def _otel_setting(otel: OtelSettings, entry: str, key: str, value: str) -> None:
    if key == "url":
        otel.url = value
    elif key == "resource":
        name, eq, attribute = value.partition("=")
        if not eq or not name:
            raise _bad(entry, "opentelemetry,resource=<key>=<value>")
        otel.resource[name] = attribute
    elif key in _BSP:
        try:
            number = int(value)
        except ValueError:
            number = 0
        if number < 1:
            raise _bad(entry, f"opentelemetry,{key}=<integer >= 1>")
        if key == "bsp_max_queue_size":
            otel.bsp_max_queue_size = number
        elif key == "bsp_schedule_delay":
            otel.bsp_schedule_delay_ms = number
        elif key == "bsp_export_timeout":
            otel.bsp_export_timeout_ms = number
        else:
            otel.bsp_max_export_batch_size = number
    else:
        raise _bad(entry, f"opentelemetry,<{'|'.join(['url', 'resource', *_BSP])}>=<value>")
