"""Triton's ``--trace-config`` entries and the CPU gauges, without sockets."""

from __future__ import annotations

import pytest

from gpuserve.engine import tracing as engine_tracing
from gpuserve.errors import ConfigError
from gpuserve.metrics.cpu import CpuCollector, read_cpu_jiffies, read_meminfo_bytes
from gpuserve.service.tracing.runtime_settings import TraceSettings
from gpuserve.service.tracing.trace_config import parse_trace_config


def test_triton_entries_become_settings_and_exporter_options():
    start = parse_trace_config(
        [
            "mode=opentelemetry",
            "rate=100",
            "level=TIMESTAMPS",
            "count=-1",
            "triton,file=t.jsonl",
            "triton,log-frequency=50",
            "opentelemetry,url=collector:4318/v1/traces",
            "opentelemetry,resource=service.name=embed",
            "opentelemetry,resource=deployment=prod",
            "opentelemetry,bsp_schedule_delay=200",
            "opentelemetry,bsp_max_queue_size=4096",
            "opentelemetry,bsp_max_export_batch_size=1024",
            "opentelemetry,bsp_export_timeout=500",
        ]
    )
    assert start.mode == "opentelemetry"
    assert start.settings == {
        "trace_rate": ["100"],
        "trace_level": ["TIMESTAMPS"],
        "trace_count": ["-1"],
        "trace_file": ["t.jsonl"],
        "log_frequency": ["50"],
    }
    otel = start.otel
    assert otel.url == "collector:4318/v1/traces"
    assert otel.resource == {"service.name": "embed", "deployment": "prod"}
    assert (otel.bsp_schedule_delay_ms, otel.bsp_max_queue_size) == (200, 4096)
    assert (otel.bsp_max_export_batch_size, otel.bsp_export_timeout_ms) == (1024, 500)
    assert parse_trace_config([]).mode == "triton"
    assert parse_trace_config([]).otel.bsp_export_timeout_ms == 3000
    # a later level replaces OFF, as repeated --trace-config level= entries do in Triton
    assert parse_trace_config(["level=OFF", "level=TIMESTAMPS"]).settings == {
        "trace_level": ["TIMESTAMPS"]
    }


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("mode=jaeger", "mode=triton or mode=opentelemetry"),
        ("sampling=1", "one of rate, level, count, mode"),
        ("triton,url=x", "triton,<file|log-frequency>"),
        ("opentelemetry,bsp_schedule_delay=soon", "bsp_schedule_delay=<integer >= 1>"),
        ("opentelemetry,resource=novalue", "opentelemetry,resource=<key>=<value>"),
        ("zipkin,url=x", "opentelemetry,<setting>"),
        ("rate", "<setting>=<value>"),
    ],
)
def test_bad_entries_are_refused_quoting_them(entry, message):
    with pytest.raises(ConfigError) as err:
        parse_trace_config([entry])
    assert repr(entry) in err.value.message and message in err.value.message


def test_export_batch_larger_than_the_queue_is_refused():
    with pytest.raises(ConfigError, match="bsp_max_export_batch_size=600 must be <= "):
        parse_trace_config(
            ["opentelemetry,bsp_max_queue_size=500", "opentelemetry,bsp_max_export_batch_size=600"]
        )


def test_tracing_on_and_off_reaches_the_engine_flag(tmp_path):
    traces = TraceSettings(tmp_path, initial={"trace_level": ["TIMESTAMPS"], "trace_rate": ["1"]})
    assert traces.active and engine_tracing.state.on
    assert traces.start("m", None, None) is not None
    other = TraceSettings(tmp_path, initial={"trace_level": ["TIMESTAMPS"]})
    traces.update({"trace_level": ["OFF"]})
    assert not traces.active and traces.start("m", None, None) is None
    assert engine_tracing.state.on  # the other tracer is still on
    other.close()
    assert not engine_tracing.state.on
    traces.close()


def test_rate_zero_only_in_opentelemetry_mode(tmp_path):
    traces = TraceSettings(tmp_path)
    with pytest.raises(Exception, match="trace_rate must be an integer >= 1"):
        traces.update({"trace_rate": ["0"]})
    traces.close()


STAT = "cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 100 0 50 800 50 0 0 0 0 0\n"
MEMINFO = "MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    400 kB\n"


def test_cpu_readings_from_proc_text():
    assert read_cpu_jiffies(STAT) == (150, 1000)
    assert read_meminfo_bytes(MEMINFO) == (1000 * 1024, 600 * 1024)
    assert read_meminfo_bytes("MemTotal: 1 kB\n") is None


def test_cpu_utilization_is_the_busy_share_since_the_last_reading(tmp_path):
    (tmp_path / "stat").write_text(STAT)
    (tmp_path / "meminfo").write_text(MEMINFO)
    now = [0.0]
    collector = CpuCollector(tmp_path, min_interval_s=1.0, clock=lambda: now[0])

    def read() -> dict[str, float]:
        return {f.name: f.samples[0].value for f in collector.collect()}

    assert read()["nv_cpu_utilization"] == pytest.approx(0.15)  # since boot
    (tmp_path / "stat").write_text("cpu  400 0 50 1500 50 0 0 0 0 0\n")  # +300 busy, +1000 all
    now[0] = 0.5
    assert read()["nv_cpu_utilization"] == pytest.approx(0.15)  # too soon: the last value
    now[0] = 2.0
    values = read()
    assert values["nv_cpu_utilization"] == pytest.approx(0.3)
    assert values["nv_cpu_memory_used_bytes"] == 600 * 1024
    assert values["nv_cpu_memory_total_bytes"] == 1000 * 1024
    empty = CpuCollector(tmp_path / "missing")
    assert list(empty.collect()) == []
