"""The :class:`~tests.integration.frontends.api.Frontend` interface over HTTP/REST (httpx).

Inputs go as JSON ``data`` (BYTES as UTF-8 text, as clients write JSON) and outputs come back
as JSON; or, with ``binary=True``, both go in the binary tensor data extension (a JSON header,
then each tensor's raw bytes; what ``tritonclient.http`` sends by default). Errors are the
body's ``error`` with the status mapped by :data:`~tests.integration.frontends.api.HTTP_STATUS`.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import numpy as np

from tests.integration.frontends.api import (
    HTTP_STATUS,
    NUMPY_DTYPE,
    FrontendError,
    IndexRow,
    InferResult,
    ModelConfigView,
    ModelMetadata,
    ModelStats,
    ServerMetadata,
    Status,
    Tensor,
    TensorMetadata,
    array_from_raw,
    raw_bytes,
)

#: One TLS context for every client: httpx builds one per client otherwise (~0.1 s each), and
#: these clients speak plain HTTP.
TLS = ssl.create_default_context()
TIMING_HEADERS = ("x-queue-time-us", "x-compute-time-us", "x-total-time-us")


def _model_path(model: str, version: str | None) -> str:
    return f"/v2/models/{model}" + ("" if version is None else f"/versions/{version}")


def error_of(response: httpx.Response) -> FrontendError:
    """The FrontendError for a non-2xx ``response``."""
    try:
        message = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    retry = response.headers.get("retry-after")
    return FrontendError(
        HTTP_STATUS.get(response.status_code, Status.UNKNOWN),
        message,
        response.status_code,
        None if retry is None else int(retry),
    )


def json_data(item: Tensor) -> list[Any]:
    """The JSON ``data`` of an input: its values flattened (BYTES decoded as UTF-8)."""
    flat = item.values.ravel()
    if item.datatype == "BYTES":
        return [value.decode() if isinstance(value, bytes) else value for value in flat]
    return flat.tolist()


def _output(out: Mapping[str, Any], raw: bytes | None) -> np.ndarray:
    shape = tuple(out["shape"])
    if raw is not None:
        return array_from_raw(raw, out["datatype"], shape)
    if out["datatype"] == "BYTES":
        array = np.empty(len(out["data"]), dtype=object)
        array[:] = [value.encode() for value in out["data"]]
        return array.reshape(shape)
    return np.array(out["data"], dtype=NUMPY_DTYPE[out["datatype"]]).reshape(shape)


def _tensors(items: Sequence[Mapping[str, Any]]) -> tuple[TensorMetadata, ...]:
    return tuple(TensorMetadata(t["name"], t["datatype"], tuple(t["shape"])) for t in items)


def _config_tensors(items: Sequence[Mapping[str, Any]]) -> tuple[TensorMetadata, ...]:
    """Tensors of Triton's ModelConfig JSON (``data_type: TYPE_FP32``, ``dims``)."""
    return tuple(
        TensorMetadata(t["name"], _CONFIG_DATATYPES[t["data_type"]], tuple(t["dims"]))
        for t in items
    )


#: Triton's ModelConfig ``TYPE_*`` -> V2 datatype (``TYPE_STRING`` is BYTES).
_CONFIG_DATATYPES = {
    **{f"TYPE_{name}": name for name in ("BOOL", "FP16", "FP32", "FP64")},
    **{
        f"TYPE_{kind}{bits}": f"{kind}{bits}"
        for kind in ("INT", "UINT")
        for bits in (8, 16, 32, 64)
    },
    "TYPE_STRING": "BYTES",
}


class HttpFrontend:
    """A client of ``url`` (``http://host:port``) over HTTP.

    Args:
        url: The server's HTTP base URL.
        token: Sent as ``Authorization: Bearer <token>`` on every call; None for none.
        binary: Send inputs and ask for outputs in the binary tensor data extension.
        timeout_s: Default client timeout per call, seconds.
    """

    kind = "http"

    def __init__(
        self, url: str, token: str | None = None, binary: bool = False, timeout_s: float = 30.0
    ) -> None:
        self.url = url
        self.token = token
        self.binary = binary
        self.encoding = "binary" if binary else "json"
        self._twin: HttpFrontend | None = None
        headers = {} if token is None else {"authorization": f"Bearer {token}"}
        self.client = httpx.Client(base_url=url, timeout=timeout_s, headers=headers, verify=TLS)

    def with_token(self, token: str | None) -> HttpFrontend:
        return HttpFrontend(self.url, token, self.binary)

    def variants(self) -> list[HttpFrontend]:
        """This client and its twin in the other encoding (JSON, binary); closed with it."""
        if self._twin is None:
            self._twin = HttpFrontend(self.url, self.token, not self.binary)
        return [self, self._twin]

    def close(self) -> None:
        self.client.close()
        if self._twin is not None:
            self._twin.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self.client.request(method, path, **kwargs)
        except httpx.TimeoutException as err:
            raise FrontendError(Status.DEADLINE_EXCEEDED, repr(err), "client timeout") from None
        except httpx.TransportError as err:
            raise FrontendError(Status.UNAVAILABLE, repr(err), "connection failed") from None

    def _ok(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._call(method, path, **kwargs)
        if response.status_code != 200:
            raise error_of(response)
        return response.json()

    def _flag(self, path: str, key: str) -> bool:
        """Readiness: 200 true, 503 false, anything else an error."""
        response = self._call("GET", path)
        if response.status_code not in (200, 503):
            raise error_of(response)
        value = response.json()[key]
        assert value == (response.status_code == 200), response.text
        return bool(value)

    # -- health and metadata ---------------------------------------------------------------

    def server_live(self) -> bool:
        return bool(self._ok("GET", "/v2/health/live")["live"])

    def server_ready(self) -> bool:
        return self._flag("/v2/health/ready", "ready")

    def server_metadata(self) -> ServerMetadata:
        body = self._ok("GET", "/v2")
        return ServerMetadata(body["name"], body["version"], tuple(body["extensions"]))

    def model_metadata(self, model: str, version: str | None = None) -> ModelMetadata:
        body = self._ok("GET", _model_path(model, version))
        return ModelMetadata(
            body["name"],
            tuple(body["versions"]),
            body["platform"],
            _tensors(body["inputs"]),
            _tensors(body["outputs"]),
        )

    def model_ready(self, model: str, version: str | None = None) -> bool:
        return self._flag(_model_path(model, version) + "/ready", "ready")

    def config(self, model: str, version: str | None = None) -> ModelConfigView:
        """Triton's ModelConfig JSON (the same content as gRPC's ModelConfig)."""
        body = self._ok("GET", _model_path(model, version) + "/config")
        batching = body["dynamic_batching"]
        policy = batching["default_queue_policy"]
        view = ModelConfigView(
            name=body["name"],
            platform=body["platform"],
            backend=body["backend"],
            max_batch_size=body["max_batch_size"],
            inputs=_config_tensors(body["input"]),
            outputs=_config_tensors(body["output"]),
            max_queue_delay_us=batching["max_queue_delay_microseconds"],
            max_queue_size=policy["max_queue_size"],
            default_timeout_us=policy["default_timeout_microseconds"],
            priority_levels=batching["priority_levels"],
        )
        # gpuserve's own view of the same configuration agrees.
        own = self._ok("GET", _model_path(model, version) + "/config/gpuserve")
        assert own["max_batch_size"] == view.max_batch_size
        assert _tensors(own["inputs"]) == view.inputs
        assert own["dynamic_batching"]["max_queue_delay_us"] == view.max_queue_delay_us
        return view

    def stats(self, model: str | None = None, version: str | None = None) -> list[ModelStats]:
        path = "/v2/models/stats" if model is None else _model_path(model, version) + "/stats"
        return [
            ModelStats(
                name=row["name"],
                version=row["version"],
                inference_count=row["inference_count"],
                execution_count=row["execution_count"],
                success_count=row["inference_stats"]["success"]["count"],
                fail_count=row["inference_stats"]["fail"]["count"],
                queue_count=row["inference_stats"]["queue"]["count"],
            )
            for row in self._ok("GET", path)["model_stats"]
        ]

    # -- repository ------------------------------------------------------------------------

    def index(self, ready_only: bool = False) -> list[IndexRow]:
        body = {"ready": True} if ready_only else {}
        rows = self._ok("POST", "/v2/repository/index", json=body)
        return [IndexRow(r["name"], r["version"], r["state"], r["reason"]) for r in rows]

    def load(self, model: str, config: Mapping[str, Any] | None = None) -> None:
        body = {} if config is None else {"parameters": {"config": json.dumps(config)}}
        self._ok("POST", f"/v2/repository/models/{model}/load", json=body)

    def unload(self, model: str) -> None:
        self._ok("POST", f"/v2/repository/models/{model}/unload")

    # -- inference -------------------------------------------------------------------------

    def infer(
        self,
        model: str,
        inputs: Sequence[Tensor],
        *,
        version: str | None = None,
        id: str | None = None,
        outputs: Sequence[str] | None = None,
        parameters: Mapping[str, int | str | bool] | None = None,
        client_timeout_s: float | None = None,
    ) -> InferResult:
        described: list[dict[str, Any]] = []
        payloads: list[bytes] = []
        for item in inputs:
            entry: dict[str, Any] = {
                "name": item.name,
                "shape": list(item.shape),
                "datatype": item.datatype,
            }
            if self.binary:
                payloads.append(raw_bytes(item))
                entry["parameters"] = {"binary_data_size": len(payloads[-1])}
            else:
                entry["data"] = json_data(item)
            described.append(entry)
        body: dict[str, Any] = {"inputs": described}
        if id is not None:
            body["id"] = id
        if outputs is not None:
            body["outputs"] = [{"name": name} for name in outputs]
        body["parameters"] = dict(parameters or {})
        if self.binary:
            body["parameters"]["binary_data_output"] = True
        if not body["parameters"]:
            del body["parameters"]
        header = json.dumps(body).encode()
        headers = {"content-type": "application/json"}
        if self.binary:
            headers = {
                "content-type": "application/octet-stream",
                "inference-header-content-length": str(len(header)),
            }
        extra: dict[str, Any] = {}
        if client_timeout_s is not None:
            extra["timeout"] = client_timeout_s
        path = _model_path(model, version) + "/infer"
        response = self._call(
            "POST", path, content=header + b"".join(payloads), headers=headers, **extra
        )
        if response.status_code != 200:
            raise error_of(response)
        answer, tails = _split_answer(response)
        described_outputs = answer["outputs"]
        return InferResult(
            model_name=answer["model_name"],
            model_version=answer["model_version"],
            id=answer.get("id", ""),
            outputs={
                out["name"]: _output(out, tails.get(out["name"])) for out in described_outputs
            },
            datatypes={out["name"]: out["datatype"] for out in described_outputs},
            timing_us={key: int(response.headers[key]) for key in TIMING_HEADERS},
        )


def _split_answer(response: httpx.Response) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The JSON part of an inference answer, and the raw bytes of each binary output."""
    length = response.headers.get("inference-header-content-length")
    if length is None:
        return response.json(), {}
    content = response.content
    answer = json.loads(content[: int(length)])
    tails: dict[str, bytes] = {}
    pos = int(length)
    for out in answer["outputs"]:
        size = (out.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            tails[out["name"]] = content[pos : pos + size]
            pos += size
    assert pos == len(content), f"{len(content) - pos} bytes after the last binary output"
    return answer, tails
