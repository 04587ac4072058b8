"""What a Triton Python model reads of a request (``correlation_id()``, ``flags()``,
``request_id()``) is its client's, whatever path the request came by: called directly, as an
ensemble's step, and through a BLS call (``tests/fixtures/row_context``), over HTTP and gRPC
with the real tritonclient."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import InProcessServer

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")

FIXTURE = Path(__file__).parents[1] / "fixtures" / "row_context"
START, END = 1, 2  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START / _END
PATHS = ["ctx_echo", "ctx_ensemble", "ctx_bls"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repository = tmp_path_factory.mktemp("row_context")
    shutil.copytree(FIXTURE, repository, dirs_exist_ok=True)
    (repository / "ctx_ensemble" / "1").mkdir(exist_ok=True)
    running = InProcessServer(repository)
    yield running
    running.stop()


def call(kind: str, server, model: str, value: int, **options) -> tuple[str, int, str, int]:
    """(ID, FLAGS, RID, OUT) the model answers for ``IN = [[value]]``."""
    module = httpclient if kind == "http" else grpcclient
    tensor = module.InferInput("IN", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    if kind == "http":
        client = httpclient.InferenceServerClient(server.url.removeprefix("http://"))
    else:
        client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        result = client.infer(model, [tensor], **options)
    finally:
        client.close()

    def one(name: str):
        return result.as_numpy(name).reshape(-1)[0]

    return one("ID").decode(), int(one("FLAGS")), one("RID").decode(), int(one("OUT"))


@pytest.mark.parametrize("kind", ["http", "grpc"])
@pytest.mark.parametrize("model", PATHS)
def test_the_model_reads_its_clients_values_on_every_path(server, kind, model):
    assert call(kind, server, model, 3, sequence_id=42, sequence_start=True, request_id="r-1") == (
        "42",
        START,
        "r-1",
        3,
    )
    assert call(kind, server, model, 4, sequence_id="s-9", sequence_end=True) == (
        "s-9",
        END,
        "",
        4,
    )
    both = call(kind, server, model, 5, sequence_id=7, sequence_start=True, sequence_end=True)
    assert both == ("7", START | END, "", 5)
    assert call(kind, server, model, 6) == ("0", 0, "", 6)  # no sequence: Triton's 0
