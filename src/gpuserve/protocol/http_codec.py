"""KServe V2 inference over HTTP: request bodies to :class:`InferenceRequest`, responses to bytes.

Wire format (Open Inference Protocol, REST, with Triton's binary tensor data extension):

* A request body is a JSON object, optionally followed by the raw bytes of the inputs that
  carry ``parameters.binary_data_size`` (in the order those inputs appear). The HTTP header
  ``Inference-Header-Content-Length`` then gives the JSON length.
* A response body is JSON, followed by the raw bytes of the outputs sent in binary (each
  listed with ``parameters.binary_data_size`` and without ``data``); the header length then
  goes back in the same HTTP header.

Policies (see also :mod:`gpuserve.protocol.tensors`):

* Unknown keys are ignored; known keys with the wrong type are refused.
* ``outputs: []`` means the same as no ``outputs``: every declared output.
* A repeated output name is refused, like a repeated input name.
* ``parameters.timeout`` is Triton's queue timeout in microseconds; 0 means "the model's
  default" (as in Triton), so it maps to ``timeout_us = None``.
* Triton's shared-memory and classification extensions (see
  :mod:`gpuserve.protocol.extension_params`): an input with ``shared_memory_region`` is read
  from that registered region (zero-copy for fixed-size types); an output with it is written
  there, and its JSON entry has name, datatype and shape only, as Triton's; an output with
  ``classification: k`` answers BYTES ``"score:index[:label]"`` strings, ``[rows, k]``.
  Shared-memory parameters are refused when the server does not allow client shared memory.
* Response casting: an output array whose dtype differs from the declared datatype is cast
  when numpy's ``same_kind`` rule allows it (float64 -> FP32, int64 -> INT32, bool -> any);
  otherwise (float -> INT64, numbers -> BYTES, ...) the model is at fault: BackendError.
* A BYTES output holding bytes that are not valid UTF-8 cannot be sent as JSON: encoding
  raises BackendError asking the client to request that output with ``binary_data``.
* FP16/FP32/FP64 NaN and infinities have no JSON form; in JSON outputs they become ``null``
  (binary outputs carry them bit-exactly).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from gpuserve.engine.checks import output_spec
from gpuserve.engine.request import InferenceRequest, InferenceResponse
from gpuserve.errors import InvalidInputError
from gpuserve.protocol.binary import bytes_as_text
from gpuserve.protocol.extension_params import BYTE_SIZE, SharedMemoryReader, shm_ref
from gpuserve.protocol.json_header import parse_json_header
from gpuserve.protocol.outputs import CLASSIFIABLE as CLASSIFIABLE
from gpuserve.protocol.outputs import OutputOptions as OutputOptions
from gpuserve.protocol.outputs import _fixed_size_output as _fixed_size_output
from gpuserve.protocol.outputs import declared_output as declared_output
from gpuserve.protocol.outputs import (
    find_spec,
    output_datatype,
    output_extensions,
    output_payload,
    spec_names,
)
from gpuserve.protocol.shapes import (
    described,
    json_type,
    missing_inputs_error,
    show,
    validate_request_shapes,
)
from gpuserve.protocol.tensors import build_input

if TYPE_CHECKING:
    from gpuserve.config import ModelConfig
    from gpuserve.protocol.limits import RequestLimits

HEADER_LENGTH_HEADER = "Inference-Header-Content-Length"
JSON_CONTENT_TYPE = "application/json"
BINARY_CONTENT_TYPE = "application/octet-stream"


@dataclass(slots=True)
class DecodedRequest:
    """A validated request and how its outputs must be encoded."""

    request: InferenceRequest
    output_options: OutputOptions


@dataclass(slots=True)
class EncodedResponse:
    """A response body ready to send.

    Attributes:
        body: JSON, followed by the binary outputs when there are any.
        header_length: Length of the JSON part when binary outputs follow it (send it as
            ``Inference-Header-Content-Length``), else None.
        content_type: ``application/json``, or ``application/octet-stream`` when binary
            outputs follow the JSON.
    """

    body: bytes
    header_length: int | None
    content_type: str


def parse_header_length(value: str | None) -> int | None:
    """Read the ``Inference-Header-Content-Length`` HTTP header.

    Args:
        value: The header's value, or None when the header is absent.

    Returns:
        The JSON length in bytes, or None when absent.

    Raises:
        InvalidInputError: not a plain non-negative decimal integer.
    """
    if value is None:
        return None
    text = value.strip()
    if not (text.isascii() and text.isdigit()):
        raise InvalidInputError(
            f"{HEADER_LENGTH_HEADER} must be a non-negative integer (the JSON length in "
            f"bytes), got {value!r}"
        )
    return int(text)


def _non_negative_int(params: dict[str, Any], key: str) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise InvalidInputError(
            f"request parameter {key!r} must be a non-negative integer, got {show(value)}"
        )
    return value


def _decode_outputs(
    outputs: Any,
    config: ModelConfig,
    model_name: str,
    options: OutputOptions,
    shm: SharedMemoryReader | None,
) -> list[str] | None:
    if outputs is None:
        return None
    if type(outputs) is not list:
        raise InvalidInputError(
            f"'outputs' must be a JSON array of output objects, got {json_type(outputs)}"
        )
    names: list[str] = []
    binary = options.binary
    for index, item in enumerate(outputs):
        if type(item) is not dict:
            raise InvalidInputError(
                f"outputs[{index}] must be a JSON object, got {described(item)}"
            )
        name = item.get("name")
        if type(name) is not str:
            raise InvalidInputError(
                f"outputs[{index}]: 'name' must be a string, got {described(name)}"
            )
        spec = output_spec(config, model_name, name)
        if name in names:
            raise InvalidInputError(f"output '{name}' already exists in request")
        names.append(name)
        params = item.get("parameters")
        if params is None:
            continue
        if type(params) is not dict:
            raise InvalidInputError(
                f"output {name!r}: 'parameters' must be a JSON object, got {json_type(params)}"
            )
        flag = params.get("binary_data")
        if flag is not None:
            if type(flag) is not bool:
                raise InvalidInputError(
                    f"output {name!r}: parameter 'binary_data' must be true or false, "
                    f"got {show(flag)}"
                )
            binary[name] = flag
        output_extensions(params, spec, flag, options, shm)
    return names or None


#: The output options of a body not decoded yet (shared, never mutated).
_NO_OPTIONS = OutputOptions({})


class HttpInferBody:
    """The body of one ``/infer`` request, decoded in two steps.

    The JSON header is parsed first, when the request id is asked for (a canary is chosen by
    it, before the tensors are decoded); :meth:`decode` then validates the tensors against the
    configuration of the version that takes the request. Implements the inference service's
    ``WireRequest``.

    Args:
        body: The whole HTTP request body.
        header_length: The ``Inference-Header-Content-Length`` header's value as sent, or
            None when absent (parsed lazily, so a bad value fails like a bad body).
        limits: Server-wide tensor limits; None: none.
        shm: The registered client shared-memory regions; None: shared-memory parameters
            are refused.

    Attributes:
        output_options: How each output goes back, set by :meth:`decode`.
    """

    __slots__ = (
        "_binary",
        "_body",
        "_document",
        "_header_value",
        "_limits",
        "_shm",
        "output_options",
    )

    def __init__(
        self,
        body: bytes | bytearray,
        header_length: str | None,
        limits: RequestLimits | None = None,
        shm: SharedMemoryReader | None = None,
    ) -> None:
        self._body = body
        self._header_value = header_length
        self._limits = limits
        self._shm = shm
        self._document: dict[str, Any] | None = None
        self._binary: memoryview | None = None
        # replaced by decode(); one shared empty value until then (never mutated)
        self.output_options = _NO_OPTIONS

    def _parsed(self) -> dict[str, Any]:
        if self._document is None:
            self._document, self._binary = _split_body(
                self._body, parse_header_length(self._header_value)
            )
        return self._document

    def request_id(self) -> str | None:
        """The request's ``id``, or None.

        Raises:
            InvalidInputError: a bad header length, malformed JSON, or an id not a string.
        """
        return _request_id(self._parsed())

    def decode(
        self, config: ModelConfig, model_name: str, model_version: str | None
    ) -> InferenceRequest:
        """Validate the tensors against ``config`` (the routed version's) and build the
        engine's request; :attr:`output_options` is set from the request's outputs.

        Args:
            config: The configuration of the version that takes the request.
            model_name: Target model (from the URL).
            model_version: Version from the URL, or None for the default version.

        Returns:
            The request: inputs as numpy arrays of the declared dtypes, batch dimension
            first when the model batches; binary fixed-size inputs are zero-copy, read-only
            views of the body.

        Raises:
            InvalidInputError: see :func:`decode_infer_request`.
        """
        document = self._document
        if document is None:  # as _parsed(), inline: this is the request path
            document, self._binary = _split_body(
                self._body, parse_header_length(self._header_value)
            )
            self._document = document
        decoded = _decode_document(
            document,
            self._binary,
            config,
            model_name,
            model_version,
            self._limits,
            self._shm,
        )
        self.output_options = decoded.output_options
        return decoded.request


def _split_body(
    body: bytes | bytearray, header_length: int | None
) -> tuple[dict[str, Any], memoryview | None]:
    """The JSON header as a document, and the binary part after it (None without a header
    length)."""
    size = len(body)
    if header_length is None:
        return parse_json_header(body, None, size), None
    if header_length > size:
        raise InvalidInputError(
            f"{HEADER_LENGTH_HEADER} {header_length} exceeds the request body size {size}"
        )
    header = body if header_length == size else body[:header_length]
    binary = memoryview(body).toreadonly()[header_length:]
    return parse_json_header(header, header_length, size), binary


def _request_id(document: dict[str, Any]) -> str | None:
    request_id = document.get("id")
    if request_id is not None and type(request_id) is not str:
        raise InvalidInputError(f"request 'id' must be a string, got {show(request_id)}")
    return request_id


def decode_infer_request(
    body: bytes | bytearray,
    header_length: int | None,
    config: ModelConfig,
    model_name: str,
    model_version: str | None,
    limits: RequestLimits | None = None,
    shm: SharedMemoryReader | None = None,
) -> DecodedRequest:
    """Decode and fully validate a V2 ``/infer`` request body.

    Args:
        body: The whole HTTP request body.
        header_length: :func:`parse_header_length` of the request's header (None when absent).
        config: The target model's configuration.
        model_name: Target model (from the URL).
        model_version: Target version from the URL, or None for the default version.
        limits: Server-wide tensor limits (see :mod:`gpuserve.protocol.limits`); None: none.
        shm: Registered client shared-memory regions; None: shared-memory parameters are
            refused.

    Returns:
        The request (inputs as numpy arrays of the declared dtypes; binary fixed-size inputs
        are zero-copy, read-only views of ``body``, shared-memory ones of the region) and its
        output options.

    Raises:
        InvalidInputError: anything wrong with the body; the message names the field, the
            value received and what is expected.
    """
    document, binary = _split_body(body, header_length)
    return _decode_document(document, binary, config, model_name, model_version, limits, shm)


def _decode_document(
    document: dict[str, Any],
    binary: memoryview | None,
    config: ModelConfig,
    model_name: str,
    model_version: str | None,
    limits: RequestLimits | None,
    shm: SharedMemoryReader | None = None,
) -> DecodedRequest:
    inputs = document.get("inputs")
    if type(inputs) is not list:
        if inputs is None:
            raise InvalidInputError(
                f"request has no 'inputs'; model {model_name!r} expects {spec_names(config.inputs)}"
            )
        raise InvalidInputError(
            f"'inputs' must be a JSON array of input objects, got {json_type(inputs)}"
        )
    if not inputs:
        raise missing_inputs_error([], config, model_name)

    arrays: dict[str, np.ndarray] = {}
    offset = 0  # into ``binary``
    binary_inputs = 0
    for index, item in enumerate(inputs):
        if type(item) is not dict:
            raise InvalidInputError(f"inputs[{index}] must be a JSON object, got {described(item)}")
        name = item.get("name")
        if type(name) is not str:
            raise InvalidInputError(
                f"inputs[{index}]: 'name' must be a string, got {described(name)}"
            )
        spec = find_spec(config.inputs, name)
        if spec is None:
            raise InvalidInputError(
                f"input {name!r} is not an input of model {model_name!r}; its inputs are "
                f"{spec_names(config.inputs)}"
            )
        if name in arrays:
            raise InvalidInputError(f"input '{name}' already exists in request")
        params = item.get("parameters")
        size_param = None
        if params is not None:
            if type(params) is not dict:
                raise InvalidInputError(
                    f"input {name!r}: 'parameters' must be a JSON object, got {json_type(params)}"
                )
            size_param = params.get("binary_data_size")
            ref = shm_ref(params, f"input {name!r}", shm)
            if ref is not None:
                if "data" in item or size_param is not None:
                    raise InvalidInputError(
                        f"input {name!r} has 'shared_memory_region' and also "
                        f"{'data' if 'data' in item else 'binary_data_size'}; send one"
                    )
                assert shm is not None
                arrays[name] = build_input(
                    spec,
                    name,
                    item.get("datatype"),
                    item.get("shape"),
                    raw=shm.view(ref.region, ref.offset, ref.byte_size).toreadonly(),
                    config=config,
                    size_label=BYTE_SIZE,
                    limits=limits,
                )
                continue
        if size_param is None:
            if "data" not in item:
                raise InvalidInputError(
                    f"input {name!r} has neither 'data' nor parameters.binary_data_size"
                )
            data = item["data"]
            if data is None:
                raise InvalidInputError(f"input {name!r}: 'data' must be a JSON array, got null")
            arrays[name] = build_input(
                spec,
                name,
                item.get("datatype"),
                item.get("shape"),
                json_data=data,
                config=config,
                limits=limits,
            )
            continue
        if "data" in item:
            raise InvalidInputError(
                f"input {name!r} has both 'data' and binary_data_size; send one or the other"
            )
        if type(size_param) is not int or size_param < 0:
            raise InvalidInputError(
                f"input {name!r}: binary_data_size must be a non-negative integer, got "
                f"{show(size_param)}"
            )
        if binary is None:
            raise InvalidInputError(
                f"input {name!r}: binary_data_size is set but the {HEADER_LENGTH_HEADER} "
                f"header is missing"
            )
        remain = len(binary) - offset
        if size_param > remain:
            raise InvalidInputError(
                f"binary data for input {name!r} is truncated: binary_data_size {size_param} "
                f"but only {remain} bytes remain"
            )
        raw = binary[offset : offset + size_param]
        offset += size_param
        binary_inputs += 1
        arrays[name] = build_input(
            spec,
            name,
            item.get("datatype"),
            item.get("shape"),
            raw=raw,
            config=config,
            limits=limits,
        )
    if binary is not None and offset != len(binary):
        extra = len(binary) - offset
        where = "the last binary input" if binary_inputs else "the JSON (no input is binary)"
        raise InvalidInputError(f"{extra} unexpected bytes after {where}")
    validate_request_shapes({name: array.shape for name, array in arrays.items()}, config)

    request_id = _request_id(document)
    params = document.get("parameters")
    if params is None:
        params = {}
    elif type(params) is not dict:
        raise InvalidInputError(
            f"request 'parameters' must be a JSON object, got {json_type(params)}"
        )
    priority = 0
    timeout_us = None
    default_binary = False
    if params:
        priority = _non_negative_int(params, "priority") or 0
        timeout_us = _non_negative_int(params, "timeout") or None
        default_binary = params.get("binary_data_output", False)
        if type(default_binary) is not bool:
            raise InvalidInputError(
                f"request parameter 'binary_data_output' must be true or false, got "
                f"{show(default_binary)}"
            )
    options = OutputOptions({}, default_binary)
    requested = _decode_outputs(document.get("outputs"), config, model_name, options, shm)
    request = InferenceRequest(
        model_name=model_name,
        model_version=model_version,
        inputs=arrays,
        requested_outputs=requested,
        id=request_id,
        parameters=params,
        priority=priority,
        timeout_us=timeout_us,
    )
    return DecodedRequest(request, options)


def encode_infer_response(
    response: InferenceResponse, options: OutputOptions, config: ModelConfig
) -> EncodedResponse:
    """Encode a response as V2 JSON, with binary outputs appended after it.

    Args:
        response: The engine's result; outputs are encoded in its dict order.
        options: From the request (:attr:`DecodedRequest.output_options`).
        config: The model's configuration (declared output datatypes).

    Returns:
        The body, the JSON length when binary outputs follow, and the content type.

    Raises:
        BackendError: an output the model does not declare, a dtype that cannot be cast to
            the declared datatype, a BYTES output that is not bytes/str, or non-UTF-8 bytes
            in a BYTES output requested as JSON.
        InvalidInputError: an output larger than the shared memory the request gave it.
    """
    entries: list[dict[str, Any]] = []
    buffers: list[Any] = []
    for name, array in response.outputs.items():
        datatype = output_datatype(config, name, array, options)
        shape = list(array.shape)
        target = options.shm.get(name)
        if target is not None:
            # as Triton: name, datatype and shape only (Triton's C++ client reads any
            # output 'parameters' as binary_data_size and fails without it)
            target.write(name, output_payload(array, datatype, name))
            entries.append({"name": name, "datatype": datatype, "shape": shape})
        elif options.binary.get(name, options.default_binary):
            payload = output_payload(array, datatype, name)
            nbytes = len(payload) if isinstance(payload, bytes) else payload.nbytes
            buffers.append(payload)
            entries.append(
                {
                    "name": name,
                    "datatype": datatype,
                    "shape": shape,
                    "parameters": {"binary_data_size": nbytes},
                }
            )
        else:
            if datatype == "BYTES":
                data: Any = bytes_as_text(array, name)
            else:
                data = _fixed_size_output(array, datatype, name).ravel()
            entries.append({"name": name, "datatype": datatype, "shape": shape, "data": data})
    document: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
    }
    if response.id is not None:
        document["id"] = response.id
    document["outputs"] = entries
    header = orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)
    if not buffers:
        return EncodedResponse(header, None, JSON_CONTENT_TYPE)
    # bytes.join reads the arrays through the buffer protocol: one copy of each payload.
    return EncodedResponse(b"".join([header, *buffers]), len(header), BINARY_CONTENT_TYPE)
