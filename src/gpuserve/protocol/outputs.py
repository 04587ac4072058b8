"""How a request's outputs go back, for both wire formats: the options a request sets
(binary or JSON, client shared memory, classification) and the checked, typed output arrays.

Used by :mod:`gpuserve.protocol.http_codec` and :mod:`gpuserve.protocol.grpc_codec`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gpuserve.datatypes import NUMPY_DTYPES
from gpuserve.errors import BackendError, InvalidInputError
from gpuserve.protocol.binary import bytes_elements, serialize_bytes
from gpuserve.protocol.extension_params import (
    SharedMemoryReader,
    ShmOutput,
    classification_count,
    shm_ref,
)

if TYPE_CHECKING:
    from gpuserve.config import ModelConfig, TensorSpec


def find_spec(specs: list[TensorSpec], name: str) -> TensorSpec | None:
    """The declared tensor called ``name`` among ``specs``, or None."""
    for spec in specs:
        if spec.name == name:
            return spec
    return None


def spec_names(specs: list[TensorSpec]) -> str:
    """The names of ``specs``, quoted and comma-separated, for error messages."""
    return ", ".join(repr(spec.name) for spec in specs)


#: Datatypes an output may have to be answered as classes (Triton's set).
CLASSIFIABLE = frozenset(
    ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64")
)


@dataclass(slots=True)
class OutputOptions:
    """How each output goes back on the wire.

    Attributes:
        binary: Output name -> explicit ``parameters.binary_data`` of that requested output
            (outputs that did not set it are absent).
        default_binary: The request parameter ``binary_data_output`` (default False); used
            for every output not in ``binary``.
        shm: Output name -> where in client shared memory it is written (those outputs go
            back without data).
        classification: Output name -> ``k`` of its ``classification`` parameter (the
            service turns those outputs into top-k BYTES strings before encoding).
    """

    binary: dict[str, bool]
    default_binary: bool = False
    shm: dict[str, ShmOutput] = field(default_factory=dict)
    classification: dict[str, int] = field(default_factory=dict)

    def is_binary(self, name: str) -> bool:
        """Whether output ``name`` is sent as raw bytes after the JSON."""
        return self.binary.get(name, self.default_binary)


def output_extensions(
    params: Any,
    spec: TensorSpec,
    binary: bool | None,
    options: OutputOptions,
    shm: SharedMemoryReader | None,
) -> None:
    """Record an output's shared-memory target and classification count in ``options``
    (both wire formats).

    Args:
        params: The requested output's parameters (``name -> value``).
        spec: The declared output.
        binary: Its explicit ``binary_data`` flag, or None.
        options: Filled in.
        shm: The server's regions; None when client shared memory is off.

    Raises:
        InvalidInputError: bad parameters, shared memory together with classification or
            ``binary_data``, classes of a datatype that has no order, or a region range that
            is not registered.
    """
    name = spec.name
    where = f"output {name!r}"
    ref = shm_ref(params, where, shm)
    count = classification_count(params, where)
    if ref is not None:
        if count:
            raise InvalidInputError(
                f"{where}: set 'shared_memory_region' or 'classification', not both"
            )
        if binary:
            raise InvalidInputError(
                f"{where}: set 'shared_memory_region' or 'binary_data', not both"
            )
        assert shm is not None
        options.shm[name] = ShmOutput(ref, shm.view(ref.region, ref.offset, ref.byte_size))
    if count:
        if spec.datatype not in CLASSIFIABLE:
            raise InvalidInputError(
                f"{where}: 'classification' needs a numeric output; {name!r} is "
                f"{spec.datatype} (expected one of {', '.join(sorted(CLASSIFIABLE))})"
            )
        options.classification[name] = count


def _fixed_size_output(array: np.ndarray, datatype: str, name: str) -> np.ndarray:
    """The output as a C-contiguous, little-endian array of the declared dtype."""
    dtype = NUMPY_DTYPES[datatype]
    if array.dtype != dtype:
        if not np.can_cast(array.dtype, dtype, casting="same_kind"):
            raise BackendError(
                f"output {name!r}: the model returned {array.dtype} values but the output "
                f"is declared {datatype}"
            )
        array = array.astype(dtype)
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array


def declared_output(config: ModelConfig, name: str, array: Any) -> TensorSpec:
    """The declared spec of output ``name``, checking the model returned an array for it.

    Raises:
        BackendError: the model does not declare ``name``, or ``array`` is not an ndarray.
    """
    spec = find_spec(config.outputs, name)
    if spec is None:
        raise BackendError(
            f"model returned output {name!r}, which it does not declare "
            f"(declared: {spec_names(config.outputs)})"
        )
    if not isinstance(array, np.ndarray):
        raise BackendError(
            f"output {name!r}: the model returned a {type(array).__name__}, not an array"
        )
    return spec


def output_datatype(config: ModelConfig, name: str, array: Any, options: OutputOptions) -> str:
    """The datatype output ``name`` goes back as: BYTES when answered as classes, else the
    declared one.

    Raises:
        BackendError: see :func:`declared_output`.
    """
    declared = declared_output(config, name, array).datatype
    return "BYTES" if name in options.classification else declared


def output_payload(array: np.ndarray, datatype: str, name: str) -> bytes | np.ndarray:
    """An output's raw bytes: serialized BYTES elements, or a C-contiguous little-endian
    array of the declared dtype (read through the buffer protocol).

    Raises:
        BackendError: as :func:`encode_infer_response`.
    """
    if datatype == "BYTES":
        return serialize_bytes(bytes_elements(array, name), name)
    return _fixed_size_output(array, datatype, name)
