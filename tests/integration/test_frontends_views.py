"""The read views over HTTP and gRPC, one test each for both protocols: health, server and
model metadata, readiness, configuration, statistics and the repository index, and the errors
every view answers for an unknown model, an unknown version and a model that failed to load
(same outcome class through one status table, same message)."""

from __future__ import annotations

import numpy as np
import pytest

import gpuserve
from gpuserve.errors import OutOfMemoryError, TooManyInputsError
from gpuserve.server.status import STATUS
from tests.conftest import FIXTURE_REPOSITORY
from tests.integration.frontends import (
    HTTP_STATUS,
    FrontendError,
    IndexRow,
    Status,
    TensorMetadata,
    tensor,
)

EXTENSIONS = (
    "binary_tensor_data",
    "statistics",
    "model_configuration",
    "model_repository",
    "generate",
    "classification",
    "trace",
    "logging",
)
MODELS = ", ".join(sorted(p.name for p in FIXTURE_REPOSITORY.iterdir() if p.is_dir()))
UNKNOWN_MODEL = (
    f"Request for unknown model: 'nope' is not found (models in the repository: {MODELS})"
)
ROW = np.arange(16, dtype=np.float32)[None]


def test_the_status_table_pairs_http_and_grpc_as_gpuserves_does():
    for error, (http, grpc_code) in STATUS.items():
        if error is OutOfMemoryError:  # 503 / RESOURCE_EXHAUSTED: a many-to-one pair
            assert (http, grpc_code) == (503, "RESOURCE_EXHAUSTED")
            continue
        if error is TooManyInputsError:  # 413 / INVALID_ARGUMENT: gRPC has no "too large"
            assert (http, grpc_code) == (413, "INVALID_ARGUMENT")
            continue
        assert HTTP_STATUS[http] == Status[grpc_code], error.__name__


def test_health_and_server_metadata(frontend):
    assert frontend.server_live() and frontend.server_ready()
    meta = frontend.server_metadata()
    assert (meta.name, meta.version, meta.extensions) == (
        "gpuserve",
        gpuserve.__version__,
        EXTENSIONS,
    )


def test_model_metadata_ready_and_config(frontend):
    double = (
        (TensorMetadata("INPUT0", "FP32", (-1, 16)),),
        (TensorMetadata("OUTPUT0", "FP32", (-1, 16)),),
    )
    for version in (None, "1"):
        meta = frontend.model_metadata("double_fp32", version)
        assert (meta.name, meta.versions, meta.platform) == ("double_fp32", ("1",), "python")
        assert (meta.inputs, meta.outputs) == double
        assert frontend.model_ready("double_fp32", version)
    torch = frontend.model_metadata("torch_linear")
    assert torch.platform == "pytorch_libtorch"

    config = frontend.config("double_fp32")
    assert (config.name, config.backend, config.platform) == ("double_fp32", "python", "python")
    assert config.max_batch_size == 8
    assert (config.max_queue_delay_us, config.max_queue_size) == (50_000, 1024)
    assert (config.default_timeout_us, config.priority_levels) == (0, 1)
    assert config.inputs == (TensorMetadata("INPUT0", "FP32", (16,)),)
    assert config.outputs == (TensorMetadata("OUTPUT0", "FP32", (16,)),)
    assert frontend.config("double_fp32", "1") == config
    echo = frontend.config("echo_bytes")
    assert [(t.name, t.datatype) for t in echo.outputs] == [("TEXT_OUT", "BYTES"), ("LEN", "INT32")]
    assert frontend.config("slow_fp32_queue_timeout").default_timeout_us == 300_000


def test_failed_model_is_reported_but_server_stays_ready(frontend):
    assert not frontend.model_ready("broken_model")
    meta = frontend.model_metadata("broken_model")  # its configuration is known
    assert (meta.versions, meta.platform) == ((), "pytorch_libtorch")
    assert frontend.config("broken_model").backend == "torch"
    assert frontend.stats("broken_model") == []
    with pytest.raises(FrontendError) as err:
        frontend.infer("broken_model", [tensor("INPUT0", ROW)])
    assert err.value.status == Status.UNAVAILABLE
    assert err.value.message.startswith(
        "model 'broken_model' is not ready: version 1 failed to load: RuntimeError: "
    )
    (broken,) = [row for row in frontend.index() if row.name == "broken_model"]
    assert (broken.version, broken.state) == ("1", "UNAVAILABLE")
    assert broken.reason.startswith("failed to load: RuntimeError: ")
    assert frontend.server_ready()
    np.testing.assert_array_equal(
        frontend.infer("double_fp32", [tensor("INPUT0", ROW)]).outputs["OUTPUT0"], ROW * 2
    )


NOT_FOUND = [
    ("infer", lambda f: f.infer("nope", [tensor("INPUT0", ROW)]), UNKNOWN_MODEL),
    ("metadata", lambda f: f.model_metadata("nope"), UNKNOWN_MODEL),
    ("ready", lambda f: f.model_ready("nope"), UNKNOWN_MODEL),
    ("config", lambda f: f.config("nope"), UNKNOWN_MODEL),
    ("stats", lambda f: f.stats("nope"), UNKNOWN_MODEL),
    (
        "infer-version",
        lambda f: f.infer("double_fp32", [tensor("INPUT0", ROW)], version="7"),
        "model 'double_fp32' has no version '7' (versions served: [1])",
    ),
    (
        "ready-version",
        lambda f: f.model_ready("double_fp32", "7"),
        "model 'double_fp32' has no version '7' (versions served: [1])",
    ),
    (
        "metadata-version",
        lambda f: f.model_metadata("double_fp32", "7"),
        "model 'double_fp32' has no version '7' (versions: [1])",
    ),
    (
        "config-version",
        lambda f: f.config("double_fp32", "7"),
        "model 'double_fp32' has no version '7' (versions: [1])",
    ),
    (
        "stats-version",
        lambda f: f.stats("double_fp32", "7"),
        "model 'double_fp32' has no version '7' (versions: [1])",
    ),
    (
        "infer-label",
        lambda f: f.infer("double_fp32", [tensor("INPUT0", ROW)], version="x1"),
        "model 'double_fp32' has no version 'x1': failed to get model version from specified "
        "version string 'x1', version should be an integral value > 0",
    ),
    (
        "metadata-label",
        lambda f: f.model_metadata("double_fp32", "x1"),
        "model 'double_fp32' has no version 'x1': failed to get model version from specified "
        "version string 'x1', version should be an integral value > 0",
    ),
]


@pytest.mark.parametrize(
    ("call", "message"), [c[1:] for c in NOT_FOUND], ids=[c[0] for c in NOT_FOUND]
)
def test_unknown_model_or_version_is_not_found(frontend, call, message):
    with pytest.raises(FrontendError) as err:
        call(frontend)
    assert err.value.status == Status.NOT_FOUND, err.value
    assert err.value.message == message


def test_statistics_and_repository_index(frontend):
    def counts():
        (stats,) = frontend.stats("double4_fp32")
        return stats

    before = counts()
    frontend.infer("double4_fp32", [tensor("INPUT0", np.ones((2, 4), np.float32))])
    after = counts()
    assert (after.name, after.version) == ("double4_fp32", "1")
    assert after.inference_count - before.inference_count == 2
    assert after.execution_count - before.execution_count == 1
    assert after.success_count - before.success_count == 1
    assert after.queue_count - before.queue_count == 1
    assert after.fail_count == before.fail_count
    assert frontend.stats("double4_fp32", "1") == [after]
    everything = {s.name for s in frontend.stats()}
    assert {"double4_fp32", "slow_fp32", "double_fp32"} <= everything
    assert "broken_model" not in everything

    index = {row.name: row for row in frontend.index()}
    assert set(index) == set(MODELS.split(", "))
    assert index["double_fp32"] == IndexRow("double_fp32", "1", "READY", "")
    assert index["broken_model"].state == "UNAVAILABLE" and index["broken_model"].reason
    ready = frontend.index(ready_only=True)
    assert {row.name for row in ready} == set(index) - {"broken_model"}
    assert all(row.state == "READY" for row in ready)
