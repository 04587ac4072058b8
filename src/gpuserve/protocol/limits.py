"""Server-wide size limits on one request's tensors, shared by the HTTP and gRPC codecs,
and on one call's inputs, shared by every embeddings and retrieval route.

The body-size limit bounds what a client can send; these bound what a model is asked to
handle: an input whose shape declares more elements than ``max_tensor_elements`` is refused
from its shape alone, before its data is read or anything is allocated from it, and a BYTES
input is refused when one of its elements is longer than ``max_bytes_element_bytes``. Both
answer 400 naming the input, the value and the setting.

One call of the embeddings and retrieval APIs (OpenAI's ``/v1/embeddings``, TEI's ``/embed``,
``/embed_sparse``, ``/predict``, ``/rerank``, ``/similarity``, ``/tokenize``, Cohere's
``/v1/rerank``) carries at most ``max_inputs_per_call`` inputs, or fewer where the model's
section sets its own cap (``rerank.max_documents``, ``classification.max_inputs``,
``sparse.max_inputs``): :meth:`RequestLimits.check_inputs` is that one check, made before
anything of the call is queued; past it the call is refused with 413 naming the cap and the
count, and nothing is computed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gpuserve.errors import InvalidInputError, TooManyInputsError

#: Most inputs one call may carry unless the server sets ``max_inputs_per_call`` (OpenAI's
#: limit for ``/v1/embeddings``).
DEFAULT_MAX_INPUTS_PER_CALL = 2048


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Limits applied to every input tensor, and to every embeddings or retrieval call.

    Attributes:
        max_tensor_elements: Most elements in one input tensor (product of its shape).
        max_bytes_element_bytes: Longest element of a BYTES input, bytes.
        max_inputs_per_call: Most inputs (texts, documents, token-id rows) in one call of
            the embeddings and retrieval APIs.
    """

    max_tensor_elements: int
    max_bytes_element_bytes: int
    max_inputs_per_call: int = DEFAULT_MAX_INPUTS_PER_CALL

    def check_inputs(
        self, param: str, count: int, model_cap: tuple[str, str, int | None] | None = None
    ) -> None:
        """Refuse a call carrying more than ``max_inputs_per_call`` inputs, or more than
        the model's own cap when it sets a lower one.

        Args:
            param: The request field that carries them (``input``, ``documents``, ...).
            count: How many the call carries.
            model_cap: ``(model, setting, cap)`` of the model's section (e.g. ``("ce",
                "rerank.max_documents", 64)``; a cap of None: the server's), or None.

        Raises:
            TooManyInputsError: names the field, the count, the cap and its setting (413).
        """
        limit = self.max_inputs_per_call
        model, setting, cap = model_cap if model_cap is not None else ("", "", None)
        if count <= limit and (cap is None or count <= cap):
            return
        if cap is not None and cap < limit:
            raise TooManyInputsError(
                f"'{param}' has {count} items, more than the {cap} model '{model}' takes in "
                f"one call ({setting}): split it",
                param,
                count,
                cap,
            )
        raise TooManyInputsError(
            f"'{param}' has {count} items, more than the {limit} this server takes in one "
            "call (max_inputs_per_call): split it",
            param,
            count,
            limit,
        )

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
