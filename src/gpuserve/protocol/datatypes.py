"""Re-export of :mod:`gpuserve.datatypes` for protocol-layer imports."""

from gpuserve.datatypes import (  # noqa: F401
    DATATYPES,
    NUMPY_DTYPES,
    Datatype,
    datatype_of,
    element_size,
    numpy_dtype,
)
