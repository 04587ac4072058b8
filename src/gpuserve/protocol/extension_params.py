"""Per-tensor parameters of Triton's shared-memory and classification extensions.

Both wire formats carry them the same way, as tensor parameters (a JSON object over HTTP,
``InferParameter`` values over gRPC, read here as a plain ``name -> value`` mapping):

* ``shared_memory_region`` (string), ``shared_memory_byte_size`` (integer, bytes) and
  ``shared_memory_offset`` (integer, bytes, default 0) on an input: its bytes are read from a
  registered region instead of the request; on a requested output: its bytes are written there
  and the response carries the tensor's name, datatype and shape without data.
* ``classification`` (integer ``k``) on a requested output: answer the top ``k`` classes of
  each row as BYTES strings ``"score:index[:label]"`` instead of the tensor.

The codecs use :func:`shm_ref` and :func:`classification_count`; the regions themselves are
reached through the small :class:`SharedMemoryReader` interface (implemented by
:class:`gpuserve.service.memory.shared_memory.SharedMemoryRegistry`), so the codecs stay pure.
Without a reader (the server does not allow client shared memory) a shared-memory parameter is
refused with 400 naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from gpuserve.errors import InvalidInputError
from gpuserve.protocol.shapes import show

REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"
SHM_KEYS = (REGION, BYTE_SIZE, OFFSET)
CLASSIFICATION = "classification"

#: What a client is told when it sends shared-memory parameters to a server without them.
DISABLED = (  # Triton's words first (its tests look for them)
    "Client shared memory is disabled. Start the server with --allow-client-shm "
    "(GPUSERVE_ALLOW_CLIENT_SHM=1) to enable."
)


class SharedMemoryReader(Protocol):
    """Views of registered shared-memory regions, bounds-checked."""

    def view(self, name: str, offset: int, byte_size: int) -> memoryview:
        """Bytes ``[offset, offset + byte_size)`` of region ``name``, zero-copy, writable.

        Raises:
            InvalidInputError: unknown region, or the range falls outside it (the message
                names the region, the offset and the sizes).
        """
        ...


@dataclass(frozen=True, slots=True)
class ShmRef:
    """Where one tensor's bytes are in client shared memory.

    Attributes:
        region: The registered region's name.
        offset: Start within the region, bytes.
        byte_size: Bytes available (inputs: exactly the tensor's bytes).
    """

    region: str
    offset: int
    byte_size: int


@dataclass(slots=True)
class ShmOutput:
    """A requested output to be written into client shared memory.

    Attributes:
        ref: Where.
        view: The writable bytes of ``ref`` (resolved when the request was decoded, so a
            region unregistered meanwhile stays mapped until the answer is written).
    """

    ref: ShmRef
    view: memoryview

    def write(self, name: str, payload: bytes | np.ndarray) -> int:
        """Copy ``payload`` (raw little-endian bytes, or serialized BYTES elements) to the
        start of the region range; returns the bytes written.

        Raises:
            InvalidInputError: the payload is larger than the ``shared_memory_byte_size``
                the request gave for this output.
        """
        data = payload.data.cast("B") if isinstance(payload, np.ndarray) else payload
        size = len(data)
        if size > self.ref.byte_size:
            raise InvalidInputError(
                f"output {name!r}: shared_memory_byte_size {self.ref.byte_size} of region "
                f"{self.ref.region!r} (offset {self.ref.offset}) is too small: the result "
                f"needs {size} bytes"
            )
        self.view[:size] = data
        return size


def _integer(params: Mapping[str, Any], key: str, where: str) -> int | None:
    value = params.get(key)
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise InvalidInputError(
            f"{where}: parameter {key!r} must be a non-negative integer, got {show(value)}"
        )
    return value


def shm_ref(
    params: Mapping[str, Any], where: str, reader: SharedMemoryReader | None
) -> ShmRef | None:
    """The shared-memory location a tensor's parameters name, or None when they name none.

    Args:
        params: The tensor's parameters (``name -> value``).
        where: How messages name the tensor (``"input 'x'"``, ``"output 'y'"``).
        reader: The server's regions; None when client shared memory is off.

    Raises:
        InvalidInputError: a shared-memory parameter without the switch, a region that is
            not a string, a size or offset that is not a non-negative integer, or a byte size
            without a region (or the reverse).
    """
    if not any(key in params for key in SHM_KEYS):
        return None
    if reader is None:
        key = next(key for key in SHM_KEYS if key in params)
        raise InvalidInputError(f"{where}: parameter {key!r}: {DISABLED}")
    region = params.get(REGION)
    if type(region) is not str or not region:
        raise InvalidInputError(
            f"{where}: parameter {REGION!r} must be the name of a registered region, got "
            f"{show(region)}"
        )
    size = _integer(params, BYTE_SIZE, where)
    if size is None:
        raise InvalidInputError(f"{where}: {REGION!r} needs {BYTE_SIZE!r} (bytes)")
    return ShmRef(region, _integer(params, OFFSET, where) or 0, size)


def classification_count(params: Mapping[str, Any], where: str) -> int:
    """The ``classification`` parameter of a requested output (0 when absent).

    Raises:
        InvalidInputError: not a non-negative integer.
    """
    return _integer(params, CLASSIFICATION, where) or 0
