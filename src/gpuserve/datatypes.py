"""KServe V2 tensor datatypes, their numpy equivalents and Triton's model-configuration names.

Datatype names are those of the Open Inference Protocol ("Tensor Data Types" in the KServe V2
specification): BOOL, UINT8..UINT64, INT8..INT64, FP16, FP32, FP64, BYTES. BF16 has no numpy
equivalent and is refused at the protocol boundary.

BYTES tensors are held as numpy ``object`` arrays whose elements are ``bytes``.
"""

from __future__ import annotations

from typing import Final, Literal

import numpy as np

Datatype = Literal[
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
]

#: V2 datatype -> numpy dtype (little-endian, as the binary extension requires).
NUMPY_DTYPES: Final[dict[str, np.dtype]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(object),
}

DATATYPES: Final[frozenset[str]] = frozenset(NUMPY_DTYPES)

#: Triton's model-configuration ``DataType`` (``config.pbtxt``'s ``data_type``) -> V2 datatype.
#: ``TYPE_STRING`` is BYTES; ``TYPE_BF16`` has no V2 equivalent here (no numpy dtype).
TRITON_DATATYPES: Final[dict[str, str]] = {
    "TYPE_BOOL": "BOOL",
    "TYPE_UINT8": "UINT8",
    "TYPE_UINT16": "UINT16",
    "TYPE_UINT32": "UINT32",
    "TYPE_UINT64": "UINT64",
    "TYPE_INT8": "INT8",
    "TYPE_INT16": "INT16",
    "TYPE_INT32": "INT32",
    "TYPE_INT64": "INT64",
    "TYPE_FP16": "FP16",
    "TYPE_FP32": "FP32",
    "TYPE_FP64": "FP64",
    "TYPE_STRING": "BYTES",
}

#: V2 datatype -> Triton's model-configuration ``DataType`` (BYTES is ``TYPE_STRING``).
CONFIG_DATATYPES: Final[dict[str, str]] = {v2: triton for triton, v2 in TRITON_DATATYPES.items()}

_BY_NUMPY: Final[dict[np.dtype, str]] = {
    dt.newbyteorder("="): name for name, dt in NUMPY_DTYPES.items() if name != "BYTES"
}


def numpy_dtype(datatype: str) -> np.dtype:
    """Return the numpy dtype of a V2 datatype name.

    Raises:
        KeyError: ``datatype`` is not a V2 datatype name.
    """
    return NUMPY_DTYPES[datatype]


def datatype_of(array: np.ndarray) -> str:
    """Return the V2 datatype name of a numpy array (``object``/``bytes``/``str`` -> BYTES).

    Raises:
        ValueError: the array's dtype has no V2 equivalent (e.g. complex).
    """
    kind = array.dtype.kind
    if kind in ("O", "S", "U"):
        return "BYTES"
    try:
        return _BY_NUMPY[array.dtype.newbyteorder("=")]
    except KeyError:
        raise ValueError(f"numpy dtype {array.dtype} has no KServe V2 datatype") from None


def element_size(datatype: str) -> int:
    """Bytes per element of a fixed-size datatype (0 for BYTES, which is variable)."""
    return 0 if datatype == "BYTES" else NUMPY_DTYPES[datatype].itemsize
