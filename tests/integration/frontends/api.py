"""What a front-end test sees, whatever the protocol: typed results, typed errors, one client
interface (:class:`Frontend`), and the status table that makes an HTTP status and a gRPC code
the same outcome.

A test written against :class:`Frontend` runs unchanged over HTTP (``httpx``) and gRPC (the
grpcio stubs of Triton's own protos, as ``tritonclient.grpc`` ships them); see
:mod:`tests.integration.frontends.http_frontend` and
:mod:`tests.integration.frontends.grpc_frontend`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np


class Status(enum.Enum):
    """An outcome class, named as gRPC names it (the HTTP statuses map onto these)."""

    OK = "OK"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    CANCELLED = "CANCELLED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"  # the client's own deadline (client side)
    UNKNOWN = "UNKNOWN"  # a status this table does not know: always a test failure


#: HTTP status -> the outcome it means, as gpuserve's one status table
#: (``gpuserve.server.status.STATUS``) pairs them. That table's only many-to-one entry,
#: OutOfMemoryError (503 over HTTP, RESOURCE_EXHAUSTED over gRPC), cannot happen without a GPU.
HTTP_STATUS: dict[int, Status] = {
    200: Status.OK,
    400: Status.INVALID_ARGUMENT,
    401: Status.UNAUTHENTICATED,
    403: Status.PERMISSION_DENIED,
    404: Status.NOT_FOUND,
    429: Status.RESOURCE_EXHAUSTED,
    499: Status.CANCELLED,
    500: Status.INTERNAL,
    503: Status.UNAVAILABLE,
}


class FrontendError(Exception):
    """A call that did not succeed, as either protocol reports it.

    Attributes:
        status: The outcome class (HTTP status or gRPC code, through :data:`HTTP_STATUS`).
        message: The server's message: the HTTP body's ``error``, or the gRPC details.
        native: What the wire said: the HTTP status (int) or the gRPC code name (str).
        retry_after_s: The ``retry-after`` header (HTTP) or trailing metadata (gRPC),
            seconds; None when absent.
    """

    def __init__(
        self, status: Status, message: str, native: int | str, retry_after_s: int | None = None
    ) -> None:
        super().__init__(f"{status.name} ({native}): {message}")
        self.status = status
        self.message = message
        self.native = native
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Tensor:
    """One input as a client sends it.

    Attributes:
        name: Input name.
        datatype: V2 datatype (``FP32``, ``INT64``, ``BYTES``, ...).
        shape: The declared shape; may disagree with ``values`` on purpose (error tests).
        values: The data, sent in row-major order whatever its own shape; numbers in the
            dtype of ``datatype``, BYTES as an ``object`` array of ``bytes``.
    """

    name: str
    datatype: str
    shape: tuple[int, ...]
    values: np.ndarray


_DATATYPES = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.int8): "INT8",
    np.dtype(np.int16): "INT16",
    np.dtype(np.int32): "INT32",
    np.dtype(np.int64): "INT64",
    np.dtype(np.uint8): "UINT8",
    np.dtype(np.uint16): "UINT16",
    np.dtype(np.uint32): "UINT32",
    np.dtype(np.uint64): "UINT64",
    np.dtype(np.float16): "FP16",
    np.dtype(np.float32): "FP32",
    np.dtype(np.float64): "FP64",
    np.dtype(object): "BYTES",
}
#: V2 datatype -> numpy dtype (little-endian, as on the wire).
NUMPY_DTYPE: dict[str, np.dtype[Any]] = {
    name: dtype.newbyteorder("<") if dtype.kind != "O" else dtype
    for dtype, name in _DATATYPES.items()
}


def tensor(
    name: str, values: Any, datatype: str | None = None, shape: Sequence[int] | None = None
) -> Tensor:
    """A :class:`Tensor` from array-like ``values``.

    Args:
        name: Input name.
        values: Array-like data; BYTES as ``bytes`` items (or an object array of them).
        datatype: V2 datatype; by default that of the array's dtype.
        shape: The declared shape; by default the array's shape.
    """
    if datatype == "BYTES" or (datatype is None and _is_bytes(values)):
        array = np.array(values, dtype=object)
        datatype = "BYTES"
    elif datatype is not None:
        array = np.asarray(values, dtype=NUMPY_DTYPE[datatype])
    else:
        array = np.asarray(values)
        datatype = _DATATYPES[array.dtype]
    return Tensor(name, datatype, tuple(array.shape if shape is None else shape), array)


def _is_bytes(values: Any) -> bool:
    flat = np.asarray(values, dtype=object).ravel()
    return flat.size > 0 and isinstance(flat[0], bytes)


def serialize_bytes(items: Sequence[bytes]) -> bytes:
    """BYTES elements on the wire: each preceded by its 4-byte little-endian length."""
    return b"".join(len(item).to_bytes(4, "little") + item for item in items)


def bytes_array(data: bytes, shape: Sequence[int]) -> np.ndarray:
    """A serialized BYTES tensor as an ``object`` array of ``bytes`` with ``shape``."""
    items, pos = [], 0
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 4], "little")
        items.append(data[pos + 4 : pos + 4 + length])
        pos += 4 + length
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array.reshape(tuple(shape))


def array_from_raw(data: bytes, datatype: str, shape: Sequence[int]) -> np.ndarray:
    """An output's raw bytes (``raw_output_contents``, binary extension) as an array."""
    if datatype == "BYTES":
        return bytes_array(data, shape)
    return np.frombuffer(data, NUMPY_DTYPE[datatype]).reshape(tuple(shape))


def raw_bytes(item: Tensor) -> bytes:
    """The ``raw_input_contents`` entry of an input: its values, little-endian, row-major."""
    if item.datatype == "BYTES":
        return serialize_bytes(list(item.values.ravel()))
    return np.ascontiguousarray(item.values, dtype=NUMPY_DTYPE[item.datatype]).tobytes()


@dataclass(frozen=True)
class InferResult:
    """A successful inference.

    Attributes:
        model_name: Echoed model name.
        model_version: The version that answered (``"1"``).
        id: Echoed request id ("" when none was sent).
        outputs: Output name -> array in the declared dtype with the answered shape (BYTES:
            ``object`` array of ``bytes``), in the order the server sent them.
        datatypes: Output name -> V2 datatype as answered.
        timing_us: ``x-queue-time-us``, ``x-compute-time-us``, ``x-total-time-us`` (headers
            over HTTP, trailing metadata over gRPC), microseconds.
    """

    model_name: str
    model_version: str
    id: str
    outputs: dict[str, np.ndarray]
    datatypes: dict[str, str]
    timing_us: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TensorMetadata:
    """One input or output in model metadata or configuration.

    Attributes:
        name: Tensor name.
        datatype: V2 datatype (a configuration's ``TYPE_STRING`` reads ``BYTES``).
        shape: Metadata: with ``-1`` for the batch dimension when batching; configuration:
            the dims without it.
    """

    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ServerMetadata:
    name: str
    version: str
    extensions: tuple[str, ...]


@dataclass(frozen=True)
class ModelMetadata:
    name: str
    versions: tuple[str, ...]
    platform: str
    inputs: tuple[TensorMetadata, ...]
    outputs: tuple[TensorMetadata, ...]


@dataclass(frozen=True)
class ModelConfigView:
    """What both protocols' configuration answers carry.

    Attributes:
        max_queue_delay_us: Dynamic batching window, microseconds.
        default_timeout_us: Queue timeout, microseconds (0: none).
    """

    name: str
    platform: str
    backend: str
    max_batch_size: int
    inputs: tuple[TensorMetadata, ...]
    outputs: tuple[TensorMetadata, ...]
    max_queue_delay_us: int
    max_queue_size: int
    default_timeout_us: int
    priority_levels: int


@dataclass(frozen=True)
class ModelStats:
    """Counts of the statistics extension for one model version (the reasons of failures are
    HTTP-only; read them with :func:`tests.integration.frontends.failure_reasons`)."""

    name: str
    version: str
    inference_count: int
    execution_count: int
    success_count: int
    fail_count: int
    queue_count: int


@dataclass(frozen=True)
class IndexRow:
    name: str
    version: str
    state: str
    reason: str


class Frontend(Protocol):
    """One client of the V2 API over one protocol. Every call raises :class:`FrontendError`
    when the server answers anything but success; a client-side deadline reads
    DEADLINE_EXCEEDED and a refused connection UNAVAILABLE, over both protocols."""

    kind: str  # "http" or "grpc"
    #: How inputs travel: "json" (HTTP JSON data), "binary" (HTTP binary tensor extension),
    #: "contents" (gRPC typed contents) or "raw" (gRPC raw_input_contents).
    encoding: str

    def with_token(self, token: str | None) -> Frontend:
        """A client of the same server that sends ``Authorization: Bearer <token>``."""
        ...

    def variants(self) -> Sequence[Frontend]:
        """This client and its twin in the protocol's other input encoding (HTTP: JSON data
        and the binary tensor extension; gRPC: typed contents and raw_input_contents)."""
        ...

    def close(self) -> None: ...

    def server_live(self) -> bool: ...

    def server_ready(self) -> bool: ...

    def server_metadata(self) -> ServerMetadata: ...

    def model_metadata(self, model: str, version: str | None = None) -> ModelMetadata: ...

    def model_ready(self, model: str, version: str | None = None) -> bool:
        """False for a known model that cannot serve; NOT_FOUND for an unknown one."""
        ...

    def config(self, model: str, version: str | None = None) -> ModelConfigView: ...

    def stats(self, model: str | None = None, version: str | None = None) -> list[ModelStats]:
        """Every version of ``model`` that has statistics (every model's when None)."""
        ...

    def index(self, ready_only: bool = False) -> list[IndexRow]: ...

    def load(self, model: str, config: Mapping[str, Any] | None = None) -> None:
        """Load or reload; ``config`` overrides the model's configuration (sent as JSON)."""
        ...

    def unload(self, model: str) -> None: ...

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
        """One inference.

        Args:
            model: Model name.
            inputs: The inputs.
            version: A version label; None for the default version.
            id: Request id to echo.
            outputs: Names of the outputs to return; None for all.
            parameters: Request parameters (``priority``; ``timeout``, microseconds).
            client_timeout_s: Give up after this long (DEADLINE_EXCEEDED), seconds.
        """
        ...


T = TypeVar("T")


def attempt(call: Callable[[], T]) -> T | FrontendError:
    """``call()``, or the FrontendError it raised (for calls made concurrently)."""
    try:
        return call()
    except FrontendError as err:
        return err


def status_of(outcome: object) -> Status:
    """OK for a result, the error's status for a :class:`FrontendError`."""
    return outcome.status if isinstance(outcome, FrontendError) else Status.OK
