"""Server-wide size limits on one request's tensors, shared by the HTTP and gRPC codecs.

The body-size limit bounds what a client can send; these bound what a model is asked to
handle: an input whose shape declares more elements than ``max_tensor_elements`` is refused
from its shape alone, before its data is read or anything is allocated from it, and a BYTES
input is refused when one of its elements is longer than ``max_bytes_element_bytes``. Both
answer 400 naming the input, the value and the setting.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpuserve.errors import InvalidInputError


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Limits applied to every input tensor.

    Attributes:
        max_tensor_elements: Most elements in one input tensor (product of its shape).
        max_bytes_element_bytes: Longest element of a BYTES input, bytes.
    """

    max_tensor_elements: int
    max_bytes_element_bytes: int

    def check_elements(self, name: str, shape: Sequence[int]) -> None:
        """Refuse ``shape`` when it holds more than ``max_tensor_elements`` elements.

        Args:
            name: Input name, for messages.
            shape: The request's shape of the input, batch dimension included.

        Raises:
            InvalidInputError: the count (exact: Python integers) exceeds the limit.
        """
        count = math.prod(shape)
        if count > self.max_tensor_elements:
            raise InvalidInputError(
                f"input {name!r}: shape {list(shape)} has {count} elements, more than this "
                f"server's limit of {self.max_tensor_elements} (max_tensor_elements)"
            )

    def check_bytes(self, name: str, array: np.ndarray) -> None:
        """Refuse a BYTES input (``object`` array of ``bytes``) with an element longer than
        ``max_bytes_element_bytes``.

        Args:
            name: Input name, for messages.
            array: The built input, any shape, dtype ``object`` holding ``bytes``.

        Raises:
            InvalidInputError: names the first element over the limit and its length.
        """
        limit = self.max_bytes_element_bytes
        flat = array.reshape(-1)
        if not flat.size or max(map(len, flat)) <= limit:
            return
        index, size = next((i, len(v)) for i, v in enumerate(flat) if len(v) > limit)
        raise InvalidInputError(
            f"input {name!r}: element {index} is {size} bytes, more than this server's limit "
            f"of {limit} bytes for one BYTES element (max_bytes_element_bytes)"
        )
