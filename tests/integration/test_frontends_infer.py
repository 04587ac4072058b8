"""Inference over HTTP and gRPC, each test once per protocol and, where the encoding matters,
in both input encodings of each (HTTP: JSON data and the binary tensor extension; gRPC: typed
contents and raw_input_contents): answers by model and by version with the id echoed and the
timing reported, BYTES and INT64 exactly, requested outputs, request parameters, zero-size
dimensions, batching (BC-09, BC-14), model failures (500 / INTERNAL) and the Triton clients
themselves."""

from __future__ import annotations

import concurrent.futures
import re

import numpy as np
import pytest

from tests.integration.frontends import FrontendError, Status, attempt, failure_reasons, tensor

ROW = np.arange(16, dtype=np.float32)
TIMING = ("x-queue-time-us", "x-compute-time-us", "x-total-time-us")


def rows(count: int, start: float = 0.0) -> np.ndarray:
    """FP32 [count, 16]: start, start + 1, ..."""
    return (np.arange(count * 16, dtype=np.float32) + start).reshape(count, 16)


def assert_alive(frontend) -> None:
    result = frontend.infer("double_fp32", [tensor("INPUT0", ROW[None])])
    np.testing.assert_array_equal(result.outputs["OUTPUT0"], ROW[None] * 2)
    other = frontend.infer("varlen_fp32", [tensor("X", np.array([[1, 2, 3]], np.float32))])
    np.testing.assert_array_equal(other.outputs["Y"], [[2, 3, 4]])


def test_infer_by_model_and_by_version_echoes_id_and_reports_timing(frontend):
    x = rows(2, 1.0)
    for client in frontend.variants():
        for version in (None, "1"):
            result = client.infer("double_fp32", [tensor("INPUT0", x)], version=version, id="r-42")
            assert (result.model_name, result.model_version, result.id) == (
                "double_fp32",
                "1",
                "r-42",
            )
            assert result.datatypes == {"OUTPUT0": "FP32"}
            assert result.outputs["OUTPUT0"].dtype == np.float32
            np.testing.assert_array_equal(result.outputs["OUTPUT0"], x * 2)
            timing = result.timing_us
            assert sorted(timing) == sorted(TIMING) and min(timing.values()) >= 0
            assert timing["x-total-time-us"] >= timing["x-compute-time-us"]
        assert client.infer("double_fp32", [tensor("INPUT0", x)]).id == ""


TEXTS = [("héllo ✓", 10), ("", 0), ("a\u0000b", 3), ("aGVsbG8=", 8)]


@pytest.mark.parametrize(("text", "length"), TEXTS)
def test_bytes_round_trip_exactly(frontend, text, length):
    for client in frontend.variants():
        result = client.infer("echo_bytes", [tensor("TEXT", [[text.encode()]])])
        assert result.datatypes == {"TEXT_OUT": "BYTES", "LEN": "INT32"}
        assert result.outputs["TEXT_OUT"].tolist() == [[text.encode()]]
        assert result.outputs["LEN"].tolist() == [[length]]


def test_bytes_rows_of_one_request_and_requested_outputs(frontend):
    texts = [[t.encode()] for t, _ in TEXTS]
    for client in frontend.variants():
        result = client.infer("echo_bytes", [tensor("TEXT", texts)], id="typed")
        assert result.outputs["TEXT_OUT"].tolist() == texts
        assert result.outputs["LEN"].tolist() == [[n] for _, n in TEXTS]
        only = client.infer("echo_bytes", [tensor("TEXT", texts)], outputs=["LEN"], id="typed")
        assert only.id == "typed" and list(only.outputs) == ["LEN"]
        assert only.outputs["LEN"].tolist() == [[n] for _, n in TEXTS]


def test_int64_beyond_2_pow_53_is_exact(frontend):
    for client in frontend.variants():
        for values in ([[2**53 + 1]], [[2**53 + 1, -(2**63), 2**63 - 1]]):
            result = client.infer("tokens_int64", [tensor("input_ids", values, "INT64")])
            assert result.outputs["ids_out"].dtype == np.int64
            assert result.outputs["ids_out"].tolist() == values


def test_priority_and_timeout_parameters_are_accepted(frontend):
    data = [tensor("INPUT0", np.zeros((1, 4), np.float32))]
    for parameters in ({"priority": 1, "timeout": 5_000_000}, {"priority": 0, "timeout": 0}):
        result = frontend.infer("double4_fp32", data, parameters=parameters)
        assert result.outputs["OUTPUT0"].tolist() == [[0.0] * 4]


def test_zero_size_non_batch_dim_returns_an_empty_output(frontend):
    for client in frontend.variants():
        result = client.infer("varlen_fp32", [tensor("X", np.zeros((1, 0), np.float32))])
        assert result.outputs["Y"].shape == (1, 0)


def test_an_empty_tensor_and_its_neighbours_in_the_same_window(frontend):
    """BC-07: a [1, 0] input in binary/raw form batched with ordinary ones."""
    plain, packed = frontend.variants()

    def normal(i: int):
        return plain.infer("varlen_fp32", [tensor("X", np.full((1, 5), float(i), np.float32))])

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        empty = pool.submit(
            packed.infer, "varlen_fp32", [tensor("X", np.zeros((1, 0), np.float32))]
        )
        others = [pool.submit(normal, i) for i in range(3)]
        assert empty.result().outputs["Y"].shape == (1, 0)
        for i, future in enumerate(others):
            assert future.result().outputs["Y"].tolist() == [[i + 1.0] * 5]


def test_torch_backend_module(frontend):
    x = np.array([[1, 1, 1, 1], [0, 0, 0, 1]], np.float32)
    result = frontend.infer("torch_linear", [tensor("x", x)])
    assert result.outputs["y"].tolist() == [[10.5, -0.5], [4.5, -0.5]]


# -- batching: every caller gets its rows (BC-09), failures stay with their request (BC-14) --


def run_concurrently(frontend, model: str, inputs: list[np.ndarray]) -> list:
    """Infer each [rows, 16] FP32 array at once; results or FrontendErrors, in order."""
    with concurrent.futures.ThreadPoolExecutor(len(inputs)) as pool:
        return list(
            pool.map(
                lambda x: attempt(lambda: frontend.infer(model, [tensor("INPUT0", x)])), inputs
            )
        )


def test_concurrent_requests_are_batched_and_each_caller_gets_its_rows(frontend):
    (before,) = frontend.stats("double_fp32")
    inputs = [rows(1 + i % 3, 1000.0 * i) for i in range(32)]
    outcomes = run_concurrently(frontend, "double_fp32", inputs)
    for x, outcome in zip(inputs, outcomes, strict=True):
        assert not isinstance(outcome, FrontendError), outcome
        np.testing.assert_array_equal(outcome.outputs["OUTPUT0"], x * 2)
    (after,) = frontend.stats("double_fp32")
    assert after.inference_count - before.inference_count == sum(len(x) for x in inputs)
    executions = after.execution_count - before.execution_count
    assert executions < 32, f"{executions} executions for 32 requests: nothing was batched"
    assert after.success_count - before.success_count == 32


def test_bc09_each_caller_gets_exactly_its_rows(frontend):
    inputs = [rows(1, 0.0), rows(3, 1000.0), rows(2, 5000.0)]
    for x, outcome in zip(
        inputs, run_concurrently(frontend, "double_fp32_wide", inputs), strict=True
    ):
        assert not isinstance(outcome, FrontendError), outcome
        assert outcome.outputs["OUTPUT0"].shape == x.shape
        np.testing.assert_array_equal(outcome.outputs["OUTPUT0"], x * 2)


WRONG_ROWS = re.compile(
    r"model 'wrong_count' returned \d+ rows in output 'OUTPUT0' for a batch of \d+ rows"
)


def test_bc09_wrong_output_rows_fail_every_member_with_internal(frontend):
    inputs = [rows(1, 0.0), rows(3, 1000.0), rows(2, 5000.0)]
    for outcome in run_concurrently(frontend, "wrong_count", inputs):
        assert isinstance(outcome, FrontendError) and outcome.status == Status.INTERNAL
        assert outcome.native in (500, "INTERNAL")
        assert WRONG_ROWS.fullmatch(outcome.message), outcome.message
    with pytest.raises(FrontendError) as err:
        frontend.infer("scalar_out", [tensor("INPUT0", ROW[None])])
    assert err.value.status == Status.INTERNAL
    assert err.value.message == (
        "model 'scalar_out' returned a scalar in output 'OUTPUT0' for a batch of 1 rows"
    )
    assert_alive(frontend)


MARKER = "model '{}' failed: ValueError: marker -999 found in the batch"


def marked(count: int, at: int) -> list[np.ndarray]:
    """``count`` one-row inputs of 1, 2, ...; the one at ``at`` carries the -999 marker."""
    inputs = [np.full((1, 16), float(i + 1), np.float32) for i in range(count - 1)]
    inputs.insert(at, np.array([[-999.0] + [0.0] * 15], np.float32))
    return inputs


def test_bc14_a_raising_batch_is_split_so_only_the_bad_request_fails(server, frontend):
    before = failure_reasons(server, "marker_fail").get("backend_error", 0)
    inputs = marked(8, 3)
    outcomes = run_concurrently(frontend, "marker_fail", inputs)
    statuses = [getattr(o, "status", Status.OK) for o in outcomes]
    assert statuses == [Status.OK] * 3 + [Status.INTERNAL] + [Status.OK] * 4
    assert outcomes[3].message == MARKER.format("marker_fail")
    for x, outcome in zip(inputs, outcomes, strict=True):
        if not isinstance(outcome, FrontendError):
            np.testing.assert_array_equal(outcome.outputs["OUTPUT0"], x * 2)
    assert failure_reasons(server, "marker_fail").get("backend_error", 0) == before + 1


def test_bc14_per_row_error_fails_only_its_request(frontend):
    (before,) = frontend.stats("marker_fail_per_row")
    outcomes = run_concurrently(frontend, "marker_fail_per_row", marked(8, 5))
    statuses = [getattr(o, "status", Status.OK) for o in outcomes]
    assert statuses == [Status.OK] * 5 + [Status.INTERNAL] + [Status.OK] * 2
    assert "marker" in outcomes[5].message
    (after,) = frontend.stats("marker_fail_per_row")
    assert after.fail_count - before.fail_count == 1


# -- the Triton clients themselves -----------------------------------------------------------


def test_triton_client_round_trip(server, frontend_kind):
    """tritonclient.http / tritonclient.grpc (binary data, request id, version) against the
    server: what the suite's own clients send is what Triton's send."""
    if frontend_kind == "http":
        import tritonclient.http as triton

        client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    else:
        import tritonclient.grpc as triton

        client = triton.InferenceServerClient(server.grpc_url)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("double_fp32")
        text = np.array([["héllo ✓".encode()], [b""], [b"a\x00b"]], dtype=object)
        bytes_input = triton.InferInput("TEXT", [3, 1], "BYTES")
        numbers = triton.InferInput("INPUT0", [2, 16], "FP32")
        if frontend_kind == "http":
            bytes_input.set_data_from_numpy(text, binary_data=True)
            numbers.set_data_from_numpy(rows(2), binary_data=True)
        else:
            bytes_input.set_data_from_numpy(text)
            numbers.set_data_from_numpy(rows(2))
        result = client.infer("echo_bytes", [bytes_input])
        assert result.as_numpy("TEXT_OUT").ravel().tolist() == text.ravel().tolist()
        assert result.as_numpy("LEN").ravel().tolist() == [10, 0, 3]
        result = client.infer("double_fp32", [numbers], model_version="1", request_id="r-7")
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), rows(2) * 2)
        response = result.get_response()
        if frontend_kind == "http":
            assert (response["id"], response["model_version"]) == ("r-7", "1")
        else:
            assert (response.id, response.model_version) == ("r-7", "1")
    finally:
        client.close()
