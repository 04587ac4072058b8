"""The bench library without sockets: load specs, statistics, the HTTP parser, request
encoding (checked against gpuserve's own decoder), metrics parsing."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from gpuserve.bench.http_client import HttpConnection, build_request, split_url
from gpuserve.bench.inputs import (
    ModelInfo,
    encode_http_body,
    generate_samples,
    load_samples,
    resolve_shape,
)
from gpuserve.bench.server_info import (
    GpuSampler,
    StatsSnapshot,
    gpu_summary,
    parse_gpu_metrics,
    stats_split,
)
from gpuserve.bench.spec import parse_levels, parse_shapes
from gpuserve.bench.stats import Recorder, WindowStats, is_stable, summarize
from gpuserve.config import ModelConfig, TensorSpec
from gpuserve.protocol import decode_infer_request, parse_header_length

# -- load specs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "levels"),
    [
        ("8", [8]),
        ("1,2,8", [1, 2, 8]),
        ("1:64:x2", [1, 2, 4, 8, 16, 32, 64]),
        ("1:48:x2", [1, 2, 4, 8, 16, 32, 48]),
        ("4:16:+4", [4, 8, 12, 16]),
        ("4:10:3", [4, 7, 10]),
        ("2:2", [2]),
    ],
)
def test_levels(text, levels):
    assert parse_levels(text) == levels


def test_rates_may_be_fractional():
    assert parse_levels("2.5,0.5", integer=False) == [0.5, 2.5]
    assert parse_levels("50.5:150.5:+50", integer=False) == [50.5, 100.5, 150.5]


@pytest.mark.parametrize("text", ["", "0", "1:64:x1", "8:4", "1.5", "1:2:3:4", "2:8:+0", "a"])
def test_bad_levels_are_refused(text):
    with pytest.raises(ValueError):
        parse_levels(text)


def test_shapes():
    assert parse_shapes(["X:16", "IDS:1,128"]) == {"X": [16], "IDS": [1, 128]}
    for bad in (["X"], ["X:a"], [":4"], ["X:-2"]):
        with pytest.raises(ValueError):
            parse_shapes(bad)


# -- statistics ------------------------------------------------------------------------------


def fill(rec: Recorder, latencies_ms, status="200", queue=-1, compute=-1, start=0.0):
    for i, ms in enumerate(latencies_ms):
        rec.add(start + i * 0.001, ms / 1000, status, queue, compute)


def test_summary_percentiles_and_errors():
    rec = Recorder()
    fill(rec, range(1, 101), queue=2000, compute=5000)  # 1..100 ms
    fill(rec, [999] * 3, status="503")
    fill(rec, [999] * 2, status="error:ConnectionResetError")
    s = summarize(rec, 0, len(rec), 2.0)
    assert s.requests == 105 and s.ok == 100
    assert s.errors == {"503": 3, "error:ConnectionResetError": 2}
    assert s.throughput == 50.0
    assert s.latency_ms[50] == pytest.approx(50.5)
    assert s.latency_ms[99] == pytest.approx(99.01)
    assert s.latency_ms[50] <= s.latency_ms[90] <= s.latency_ms[95] <= s.latency_ms[99]
    assert s.max_ms == pytest.approx(100.0)  # failures do not count in latency
    assert s.queue_ms == 2.0 and s.compute_ms == 5.0


def test_summary_without_timing_headers_or_successes():
    rec = Recorder()
    fill(rec, [5, 6])
    assert summarize(rec, 0, 2, 1.0).queue_ms is None
    fill(rec, [1], status="429")
    s = summarize(rec, 2, 3, 1.0)
    assert s.ok == 0 and s.throughput == 0 and s.latency_ms[99] != s.latency_ms[99]  # NaN


def window(throughput: float, mean_ms: float) -> WindowStats:
    return WindowStats(1.0, 10, 10, {}, throughput, {50: 1, 90: 1, 95: 1, 99: 1}, mean_ms, 1)


def test_stability_needs_the_last_windows_to_agree():
    assert not is_stable([window(100, 10), window(101, 10)], 3, 0.1)
    assert is_stable([window(50, 30), window(100, 10), window(105, 10.5), window(95, 9.8)], 3, 0.1)
    assert not is_stable([window(100, 10), window(130, 10), window(100, 10)], 3, 0.1)
    assert not is_stable([window(100, 10), window(100, 14), window(100, 10)], 3, 0.1)
    assert not is_stable([window(0, float("nan"))] * 3, 3, 0.1)


# -- the HTTP client's parser (fed by hand: no sockets) ----------------------------------------


class FakeTransport:
    def __init__(self):
        self.written = []
        self.closed = False

    def write(self, data):
        self.written.append(data)

    def close(self):
        self.closed = True


def exchange(chunks: list[bytes]):
    async def main():
        conn = HttpConnection()
        transport = FakeTransport()
        conn.connection_made(transport)
        future = conn.request(b"GET / HTTP/1.1\r\n\r\n")
        for chunk in chunks:
            conn.data_received(chunk)
        assert future.done()
        return await future, conn, transport

    return asyncio.run(main())


def test_parses_a_response_split_anywhere():
    raw = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nX-Queue-Time-Us: 120\r\n"
        b'x-compute-time-us: 3400\r\ncontent-length: 11\r\n\r\n{"ok":true}'
    )
    for cut in (5, 20, len(raw) - 3):
        response, conn, _ = exchange([raw[:cut], raw[cut:]])
        assert response.status == 200 and response.body == b'{"ok":true}'
        assert response.headers["x-queue-time-us"] == "120"
        assert response.headers["x-compute-time-us"] == "3400"
        assert not conn.closed


def test_parses_chunked_bodies_and_connection_close():
    raw = (
        b"HTTP/1.1 503 Service Unavailable\r\ntransfer-encoding: chunked\r\n"
        b"connection: close\r\n\r\n4\r\nabcd\r\n3;x=1\r\nefg\r\n0\r\n\r\n"
    )
    response, conn, transport = exchange([raw[:60], raw[60:]])
    assert response.status == 503 and response.body == b"abcdefg"
    assert conn.closed and transport.closed


def test_a_lost_connection_fails_the_request():
    async def main():
        conn = HttpConnection()
        conn.connection_made(FakeTransport())
        future = conn.request(b"x")
        conn.connection_lost(None)
        with pytest.raises(ConnectionResetError):
            await future
        with pytest.raises(ConnectionResetError):
            conn.request(b"x")

    asyncio.run(main())


def test_garbage_is_a_protocol_error():
    from gpuserve.bench.http_client import HttpProtocolError

    async def main():
        conn = HttpConnection()
        conn.connection_made(FakeTransport())
        future = conn.request(b"x")
        conn.data_received(b"SSH-2.0-OpenSSH\r\n\r\n")
        with pytest.raises(HttpProtocolError):
            await future

    asyncio.run(main())


def test_urls_and_request_bytes():
    assert split_url("127.0.0.1:8000") == ("127.0.0.1", 8000, "")
    assert split_url("http://h:1/prefix/") == ("h", 1, "/prefix")
    assert split_url("https://h") == ("h", 443, "")
    with pytest.raises(ValueError, match="only http:// and https://"):
        split_url("ftp://h")
    raw = build_request("POST", "h", 1, "/v2/x", b"{}", {"Content-Type": "application/json"})
    assert raw == (
        b"POST /v2/x HTTP/1.1\r\nHost: h:1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    )


# -- request data ----------------------------------------------------------------------------

METADATA = {
    "name": "m",
    "inputs": [
        {"name": "IDS", "datatype": "INT64", "shape": [-1, -1]},
        {"name": "TEXT", "datatype": "BYTES", "shape": [-1, 1]},
        {"name": "X", "datatype": "FP16", "shape": [-1, 4]},
        {"name": "FLAG", "datatype": "BOOL", "shape": [-1, 1]},
    ],
    "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1, 4]}],
}
CONFIG = ModelConfig(
    name="m",
    max_batch_size=8,
    inputs=[
        TensorSpec(name="IDS", datatype="INT64", shape=[-1]),
        TensorSpec(name="TEXT", datatype="BYTES", shape=[1]),
        TensorSpec(name="X", datatype="FP16", shape=[4]),
        TensorSpec(name="FLAG", datatype="BOOL", shape=[1]),
    ],
    outputs=[TensorSpec(name="Y", datatype="FP32", shape=[4])],
)


def info(config=None) -> ModelInfo:
    return ModelInfo.from_metadata(METADATA, config, None)


def test_batching_is_read_from_config_or_guessed_from_metadata():
    assert info().batching
    assert not info({"max_batch_size": 0}).batching
    flat = {"inputs": [{"name": "A", "datatype": "FP32", "shape": [3]}]}
    assert not ModelInfo.from_metadata(flat, None, None).batching


def test_generated_samples_follow_the_metadata():
    samples = generate_samples(info(), batch_size=3, shapes={"IDS": [7]}, count=4)
    assert len(samples) == 4
    s = samples[0]
    assert s["IDS"].shape == (3, 7) and s["IDS"].dtype == np.int64 and s["IDS"].min() >= 0
    assert s["TEXT"].shape == (3, 1) and isinstance(s["TEXT"][0, 0], bytes)
    assert s["X"].shape == (3, 4) and s["X"].dtype == np.float16
    assert s["FLAG"].dtype == bool
    assert not np.array_equal(samples[0]["X"], samples[1]["X"])
    again = generate_samples(info(), batch_size=3, shapes={"IDS": [7]}, count=4)
    assert np.array_equal(samples[0]["X"], again[0]["X"])  # seeded


def test_shape_overrides_are_checked():
    tensor = info().inputs[2]  # X [-1, 4]
    with pytest.raises(ValueError, match="conflicts"):
        resolve_shape(info(), tensor, 1, {"X": [5]})
    with pytest.raises(ValueError, match="dims given"):
        resolve_shape(info(), tensor, 1, {"X": [4, 1]})
    assert resolve_shape(info(), info().inputs[0], 2, {}) == [2, 1]


@pytest.mark.parametrize("binary", [False, True])
def test_encoded_requests_decode_with_gpuserves_own_decoder(binary):
    sample = generate_samples(info(), batch_size=2, shapes={"IDS": [5]}, count=1)[0]
    body, headers = encode_http_body(info(), sample, binary)
    length = parse_header_length(headers.get("Inference-Header-Content-Length"))
    decoded = decode_infer_request(body, length, CONFIG, "m", None)
    for name, array in sample.items():
        assert np.array_equal(decoded.request.inputs[name], array), name
    if binary:
        assert json.loads(body[:length])["outputs"] == [
            {"name": "Y", "parameters": {"binary_data": True}}
        ]


def test_input_data_file(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(
        json.dumps(
            {
                "data": [
                    {
                        "IDS": {"content": [1, 2, 3], "shape": [1, 3]},
                        "TEXT": ["hello"],
                        "X": [1, 2, 3, 4],
                        "FLAG": [True],
                    }
                ]
            }
        )
    )
    [sample] = load_samples(path, info())
    assert sample["IDS"].tolist() == [[1, 2, 3]] and sample["TEXT"].tolist() == [[b"hello"]]
    assert sample["X"].dtype == np.float16 and sample["X"].shape == (1, 4)
    path.write_text(json.dumps({"data": [{"NOPE": [1]}]}))
    with pytest.raises(ValueError, match="unknown inputs"):
        load_samples(path, info())
    path.write_text(json.dumps({"data": [{"IDS": [1], "TEXT": ["a"], "X": [1, 2], "FLAG": [1]}]}))
    with pytest.raises(ValueError, match="do not fit"):
        load_samples(path, info())


# -- server-side numbers ---------------------------------------------------------------------


def test_statistics_split_between_snapshots():
    before = StatsSnapshot(
        success_count=10,
        queue_ns=10_000_000,
        queue_count=10,
        compute_ns=40_000_000,
        compute_count=4,
        execution_count=4,
        inference_count=10,
    )
    after = StatsSnapshot(
        success_count=30,
        queue_ns=50_000_000,
        queue_count=30,
        compute_ns=100_000_000,
        compute_count=9,
        execution_count=9,
        inference_count=30,
    )
    split = stats_split(before, after)
    assert split == {"queue_ms": 2.0, "compute_ms": 12.0, "rows_per_batch": 4.0}
    assert stats_split(after, after) is None and stats_split(None, after) is None


def test_gpu_series_are_read_from_the_exposition():
    text = "\n".join(
        [
            "# HELP gpuserve_gpu_utilization_ratio GPU utilisation",
            'gpuserve_gpu_utilization_ratio{gpu="0"} 0.5',
            'gpuserve_gpu_utilization_ratio{gpu="1"} 0.7',
            'gpuserve_gpu_memory_used_bytes{gpu="0"} 1e9',
            'gpuserve_gpu_memory_used_bytes{gpu="1"} 2e9',
            'nv_gpu_utilization{gpu_uuid="GPU-1"} 0.9',
            "gpuserve_requests_total 5",
            "gpuserve_gpu_power_watts NaN",
        ]
    )
    values = parse_gpu_metrics(text)
    assert 'gpuserve_gpu_utilization_ratio{gpu="0"}' in values and len(values) == 5
    sampler = GpuSampler()
    sampler.add(values)
    sampler.add({k: v * 3 for k, v in values.items()})
    summary = gpu_summary(sampler.means())
    assert summary["gpu_utilization"] == pytest.approx((1.0 + 1.4 + 1.8) / 3)
    assert summary["gpu_memory_used_bytes"] == pytest.approx(6e9)
    assert gpu_summary(GpuSampler().means()) == {}


def test_a_request_past_its_timeout_fails_and_drops_the_connection():
    from gpuserve.bench.inputs import TensorInfo
    from gpuserve.bench.targets import HttpTarget

    async def main():
        model = ModelInfo("m", None, [TensorInfo("X", "FP32", [-1, 2])], [], batching=True)
        target = HttpTarget("http://127.0.0.1:1", model, generate_samples(model, count=1),
                            timeout_s=0.5)  # fmt: skip
        session = await target.session()
        conn = HttpConnection()
        transport = FakeTransport()
        conn.connection_made(transport)
        session.conn = conn
        pending = asyncio.ensure_future(session.infer(0))
        await asyncio.sleep(0)
        target.check_timeouts(session.started_s + 0.1)  # not yet
        assert not pending.done()
        target.check_timeouts(session.started_s + 1.0)
        with pytest.raises(TimeoutError):
            await pending
        assert transport.closed and session.started_s == 0.0

    asyncio.run(main())
