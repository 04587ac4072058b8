"""KServe V2 inference over gRPC: ``ModelInferRequest`` to :class:`InferenceRequest` and back.

Wire format (Open Inference Protocol, gRPC, ``inference.GRPCInferenceService``):

* Each input carries its data either as typed values in ``contents`` (the one field of its
  datatype: ``int_contents`` for INT8/INT16/INT32, ``int64_contents`` for INT64,
  ``fp32_contents`` for FP32, ``bytes_contents`` for BYTES, ...) or as raw bytes in the
  request's ``raw_input_contents``, one entry per input in the order of ``inputs``
  (little-endian, row-major; each BYTES element preceded by its 4-byte little-endian length).
* Outputs always go back as ``raw_output_contents`` in the order of ``outputs``, which is what
  ``tritonclient.grpc`` reads.

Validation is the code the HTTP codec uses (:mod:`gpuserve.protocol.tensors`): the datatype must
equal the declared one, the shape must fit the declared shape, and the element count or byte
size must match the shape; messages name the input, what was received and what was expected.

Policies (those of Triton where Triton has one):

* ``raw_input_contents`` is all or none: when used it holds exactly one entry per input, and
  no input may also carry ``contents`` (refused first, with Triton's text: ``contents field
  must not be specified when using raw_input_contents for 'INPUT0' for model 'simple'``).
* Typed values must be in the field of the tensor's datatype (INT64 values in
  ``int_contents`` are refused, never widened); INT8/INT16/UINT8/UINT16 values are checked
  against their range. FP16 has no typed field: it travels in ``raw_input_contents`` only.
* Request parameters: ``priority`` (1 = highest) and ``timeout`` (queue timeout,
  microseconds; 0 = the model's default), as non-negative integers; others are kept in
  :attr:`InferenceRequest.parameters` and otherwise ignored.
* Triton's shared-memory and classification extensions, as over HTTP
  (:mod:`gpuserve.protocol.extension_params`): an input with ``shared_memory_region`` is read
  from the region and has no ``raw_input_contents`` entry (as ``tritonclient`` sends it); an
  output with it is written there and its ``raw_output_contents`` entry stays empty (one entry
  per output, as Triton answers); ``classification: k`` answers BYTES
  ``"score:index[:label]"`` strings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from gpuserve.datatypes import NUMPY_DTYPES
from gpuserve.engine.checks import output_spec
from gpuserve.engine.request import InferenceRequest, InferenceResponse
from gpuserve.errors import InvalidInputError
from gpuserve.protocol.extension_params import SHM_KEYS, SharedMemoryReader, shm_ref
from gpuserve.protocol.outputs import (
    OutputOptions,
    find_spec,
    output_datatype,
    output_extensions,
    output_payload,
    spec_names,
)
from gpuserve.protocol.protos import grpc_service_pb2 as pb
from gpuserve.protocol.shapes import (
    check_datatype,
    check_shape,
    element_count,
    format_shape,
    missing_inputs_error,
    show,
    validate_request_shapes,
)
from gpuserve.protocol.tensors import build_input

if TYPE_CHECKING:
    from gpuserve.config import ModelConfig, TensorSpec
    from gpuserve.protocol.limits import RequestLimits

#: How messages name the size of a raw input.
RAW_SIZE_LABEL = "raw_input_contents size"

#: V2 datatype -> the ``InferTensorContents`` field that carries its typed values.
CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}
_FIELDS = tuple(dict.fromkeys(CONTENTS_FIELD.values()))
#: Datatypes narrower than their contents field: values are range-checked.
_NO_OPTIONS = OutputOptions({})
_NARROW = {
    name: (int(np.iinfo(NUMPY_DTYPES[name]).min), int(np.iinfo(NUMPY_DTYPES[name]).max))
    for name in ("INT8", "INT16", "UINT8", "UINT16")
}


def parameter_value(param: pb.InferParameter) -> Any:
    """The Python value of an ``InferParameter`` (None when no choice is set)."""
    choice = param.WhichOneof("parameter_choice")
    return None if choice is None else getattr(param, choice)


def _non_negative_int(params: dict[str, Any], key: str) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise InvalidInputError(
            f"request parameter {key!r} must be a non-negative integer, got {show(value)}"
        )
    return value


def _used_fields(contents: pb.InferTensorContents) -> list[str]:
    return [field for field in _FIELDS if len(getattr(contents, field))]


def array_from_contents(
    spec: TensorSpec, name: str, shape: tuple[int, ...], contents: pb.InferTensorContents
) -> np.ndarray:
    """Build an input array from typed ``contents`` (datatype and shape already validated).

    Args:
        spec: The declared input.
        name: Input name, for messages.
        shape: The validated request shape.
        contents: The input's ``contents`` message.

    Returns:
        An array of the declared dtype with ``shape`` (BYTES: ``object`` array of ``bytes``).

    Raises:
        InvalidInputError: values in another field than the datatype's, a datatype with no
            typed field (FP16), an element count that differs from the shape's, or a value
            out of range for INT8/INT16/UINT8/UINT16.
    """
    datatype = spec.datatype
    want = CONTENTS_FIELD.get(datatype)
    used = _used_fields(contents)
    count = element_count(shape)
    if want is None:
        raise InvalidInputError(
            f"input {name!r}: {datatype} has no typed contents field; send its data in "
            f"raw_input_contents"
        )
    if len(used) > 1:
        raise InvalidInputError(
            f"input {name!r}: data is in several contents fields ({', '.join(used)}); "
            f"{datatype} data goes in contents.{want} only"
        )
    if used and used[0] != want:
        raise InvalidInputError(
            f"input {name!r}: {datatype} data must be in contents.{want}, got contents.{used[0]}"
        )
    values = getattr(contents, want)
    if len(values) != count:
        if not used:
            raise InvalidInputError(
                f"input {name!r}: no data: shape {format_shape(shape)} needs {count} elements "
                f"in contents.{want} or raw_input_contents"
            )
        raise InvalidInputError(
            f"input {name!r}: shape {format_shape(shape)} needs {count} elements, got "
            f"{len(values)} in contents.{want}"
        )
    array: np.ndarray
    if datatype == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = list(values)
    elif datatype in _NARROW:
        wide = np.fromiter(values, dtype=np.int64, count=count)
        low, high = _NARROW[datatype]
        bad = np.flatnonzero((wide < low) | (wide > high))
        if bad.size:
            index = int(bad[0])
            raise InvalidInputError(
                f"input {name!r}: element {index} ({int(wide[index])}) is out of range for "
                f"{datatype} ({low}..{high})"
            )
        array = wide.astype(NUMPY_DTYPES[datatype])
    else:
        array = np.fromiter(values, dtype=NUMPY_DTYPES[datatype], count=count)
    try:
        return array.reshape(shape)
    except ValueError as err:  # an empty tensor whose other dims exceed numpy's limits
        raise InvalidInputError(
            f"input {name!r}: shape {format_shape(shape)} cannot be represented: {err}"
        ) from None


def _decode_outputs(
    outputs: Any,
    config: ModelConfig,
    model_name: str,
    options: OutputOptions,
    shm: SharedMemoryReader | None,
) -> list[str] | None:
    names: list[str] = []
    for item in outputs:
        name = item.name
        spec = output_spec(config, model_name, name)
        if name in names:
            raise InvalidInputError(f"output '{name}' already exists in request")
        if item.parameters:
            params = {key: parameter_value(value) for key, value in item.parameters.items()}
            binary = params.get("binary_data")
            output_extensions(params, spec, binary if type(binary) is bool else None, options, shm)
        names.append(name)
    return names or None


def decode_infer_request(
    message: pb.ModelInferRequest,
    config: ModelConfig,
    model_name: str,
    model_version: str | None,
    limits: RequestLimits | None = None,
    shm: SharedMemoryReader | None = None,
    options: OutputOptions | None = None,
) -> InferenceRequest:
    """Validate a ``ModelInferRequest`` and build the engine's request.

    Args:
        message: The request as received.
        config: The target model's configuration.
        model_name: Target model.
        model_version: Target version, or None for the default version.
        limits: Server-wide tensor limits (see :mod:`gpuserve.protocol.limits`); None: none.
        shm: Registered client shared-memory regions; None: shared-memory parameters are
            refused.
        options: Filled with the outputs' shared-memory targets and classification counts.

    Returns:
        The request; raw fixed-size inputs are zero-copy, read-only views of the message's
        ``raw_input_contents`` bytes (shared-memory ones: of the region).

    Raises:
        InvalidInputError: anything wrong with the request; the message names the field, the
            value received and what is expected.
    """
    inputs = message.inputs
    if not inputs:
        raise missing_inputs_error([], config, model_name)
    raw = message.raw_input_contents
    if raw:  # Triton's check and text, before any count of the entries
        for tensor in inputs:
            if tensor.HasField("contents") and SHM_KEYS[0] not in tensor.parameters:
                raise InvalidInputError(
                    f"contents field must not be specified when using raw_input_contents "
                    f"for '{tensor.name}' for model '{model_name}'"
                )
    # inputs whose data travel in the message (not those naming a shared-memory region)
    in_message = len(inputs) - sum(1 for t in inputs if SHM_KEYS[0] in t.parameters)
    if raw and len(raw) != in_message:
        raise InvalidInputError(
            f"raw_input_contents has {len(raw)} entries for {in_message} inputs; when it is "
            f"used it must hold one entry per input (but those in shared memory), in the "
            f"order of 'inputs'"
        )
    arrays: dict[str, np.ndarray] = {}
    index = -1  # of the input's entry in raw_input_contents
    for tensor in inputs:
        name = tensor.name
        spec = find_spec(config.inputs, name)
        if spec is None:
            raise InvalidInputError(
                f"input {name!r} is not an input of model {model_name!r}; its inputs are "
                f"{spec_names(config.inputs)}"
            )
        if name in arrays:
            raise InvalidInputError(f"input '{name}' already exists in request")
        datatype = tensor.datatype or None
        shape = list(tensor.shape)
        if tensor.parameters:
            params = {key: parameter_value(value) for key, value in tensor.parameters.items()}
            ref = shm_ref(params, f"input {name!r}", shm)
            if ref is not None:
                if tensor.HasField("contents") and _used_fields(tensor.contents):
                    raise InvalidInputError(
                        f"input {name!r} has 'shared_memory_region' and also data in the "
                        f"message; send one"
                    )
                assert shm is not None
                arrays[name] = build_input(
                    spec,
                    name,
                    datatype,
                    shape,
                    raw=shm.view(ref.region, ref.offset, ref.byte_size).toreadonly(),
                    config=config,
                    size_label="shared_memory_byte_size",
                    limits=limits,
                )
                continue
        index += 1
        if raw:  # no input has contents (checked above)
            arrays[name] = build_input(
                spec,
                name,
                datatype,
                shape,
                raw=raw[index],
                config=config,
                size_label=RAW_SIZE_LABEL,
                limits=limits,
            )
            continue
        check_datatype(spec, name, datatype)
        dims = check_shape(spec, name, shape, config.max_batch_size)
        if limits is not None:
            limits.check_elements(name, dims)
        arrays[name] = array_from_contents(spec, name, dims, tensor.contents)
        if limits is not None and spec.datatype == "BYTES":
            limits.check_bytes(name, arrays[name])
    validate_request_shapes({name: array.shape for name, array in arrays.items()}, config)

    params = {key: parameter_value(value) for key, value in message.parameters.items()}
    priority = 0
    timeout_us = None
    if params:
        priority = _non_negative_int(params, "priority") or 0
        timeout_us = _non_negative_int(params, "timeout") or None
    return InferenceRequest(
        model_name=model_name,
        model_version=model_version,
        inputs=arrays,
        requested_outputs=_decode_outputs(
            message.outputs,
            config,
            model_name,
            OutputOptions({}) if options is None else options,
            shm,
        ),
        id=message.id or None,
        parameters=params,
        priority=priority,
        timeout_us=timeout_us,
    )


class GrpcInferMessage:
    """A ``ModelInferRequest`` as the inference service's ``WireRequest``: the id is a field
    of the message; :meth:`decode` validates the rest against the routed version's config.

    Args:
        message: The request as received.
        limits: Server-wide tensor limits; None: none.
        shm: The registered client shared-memory regions; None: shared-memory parameters
            are refused.

    Attributes:
        output_options: The outputs' shared-memory targets and classification counts, set
            by :meth:`decode` (pass it to :func:`encode_infer_response`).
    """

    __slots__ = ("limits", "message", "output_options", "shm")

    def __init__(
        self,
        message: pb.ModelInferRequest,
        limits: RequestLimits | None = None,
        shm: SharedMemoryReader | None = None,
    ) -> None:
        self.message = message
        self.limits = limits
        self.shm = shm
        self.output_options = OutputOptions({})

    def request_id(self) -> str | None:
        """The request's ``id``, or None when empty."""
        return self.message.id or None

    def decode(
        self, config: ModelConfig, model_name: str, model_version: str | None
    ) -> InferenceRequest:
        """Validate the message against ``config`` (the routed version's) and build the
        engine's request.

        Args:
            config: The configuration of the version that takes the request.
            model_name: Target model.
            model_version: Requested version, or None for the default version.

        Returns:
            The request: inputs as numpy arrays of the declared dtypes, batch dimension
            first when the model batches; raw fixed-size inputs are zero-copy, read-only
            views of ``raw_input_contents``.

        Raises:
            InvalidInputError: see :func:`decode_infer_request`.
        """
        self.output_options = OutputOptions({})
        return decode_infer_request(
            self.message,
            config,
            model_name,
            model_version,
            self.limits,
            self.shm,
            self.output_options,
        )


def encode_infer_response(
    response: InferenceResponse, config: ModelConfig, options: OutputOptions | None = None
) -> pb.ModelInferResponse:
    """Encode the engine's response; every output goes in ``raw_output_contents`` (an
    empty entry for one written to shared memory).

    Args:
        response: The engine's result; outputs are encoded in its dict order.
        config: The model's configuration (declared output datatypes).
        options: :attr:`GrpcInferMessage.output_options` (shared-memory targets, outputs
            answered as classes); None: none.

    Raises:
        BackendError: an output the model does not declare, a dtype that cannot be cast to
            the declared datatype, or a BYTES output that is not bytes/str.
        InvalidInputError: an output larger than the shared memory the request gave it.
    """
    if options is None:
        options = _NO_OPTIONS
    tensors: list[pb.ModelInferResponse.InferOutputTensor] = []
    payloads: list[bytes] = []
    for name, array in response.outputs.items():
        datatype = output_datatype(config, name, array, options)
        payload = output_payload(array, datatype, name)
        tensor = pb.ModelInferResponse.InferOutputTensor(
            name=name, datatype=datatype, shape=array.shape
        )
        target = options.shm.get(name)
        if target is not None:
            target.write(name, payload)
            payloads.append(b"")  # as Triton: one (empty) entry per output
        else:
            payloads.append(payload if isinstance(payload, bytes) else payload.tobytes())
        tensors.append(tensor)
    return pb.ModelInferResponse(
        model_name=response.model_name,
        model_version=response.model_version,
        id=response.id or "",
        outputs=tensors,
        raw_output_contents=payloads,
    )
