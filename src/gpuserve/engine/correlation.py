"""A request's sequence id, carried per batch row to the models that read it.

Triton hands a Python model's ``execute`` each request with its correlation id
(``request.correlation_id()``: the client's ``sequence_id``, an integer or a string; 0 when
it sent none), for sequence models and for every other model that receives one. gpuserve's
backends get a batch's stacked input arrays, not its requests, so the id travels as one more
input: at admission a request that names a ``sequence_id`` to a model whose backend reads the
ids (``Capabilities.reads_row_ids``: Triton Python models) gets :data:`CORRELATION_INPUT`, an
``object`` array with the id on each of its rows (``[rows]``; ``[1]`` without batching).
Stacking then lines the ids up with the rows (a sequence batch's filler row carries ``b""``),
and the python backend takes the input out again before any model code sees the inputs
(:mod:`gpuserve.backends.triton_python.backend`).

A request's input names are part of its batching key, so requests with a sequence id batch
with each other and those without with each other (never one batch of both). Models whose
inputs are padded into batches, and decoupled models (their requests are never stacked: the
id reaches the backend with the request's parameters), get no such input.
"""

from __future__ import annotations

import numpy as np

from gpuserve.backends.base import Capabilities
from gpuserve.backends.correlation import CORRELATION_INPUT, sequence_id_of
from gpuserve.config import ModelConfig
from gpuserve.engine.request import InferenceRequest

__all__ = ["CORRELATION_INPUT", "add_correlation_input", "sequence_id_of", "wants_correlation_ids"]


def wants_correlation_ids(config: ModelConfig, padded: bool, capabilities: Capabilities) -> bool:
    """Whether requests to the model get :data:`CORRELATION_INPUT` at admission: its
    backend reads the ids (``Capabilities.reads_row_ids``: Triton Python models), and its
    requests are stacked unpadded.

    Args:
        config: The model's configuration.
        padded: Whether its variable-length inputs are padded into batches.
        capabilities: What its instances declared at load (all of them).
    """
    if config.model_transaction_policy.decoupled or padded:
        return False
    return capabilities.reads_row_ids


def add_correlation_input(request: InferenceRequest, rows: int) -> None:
    """Give ``request`` its :data:`CORRELATION_INPUT` when it names a sequence id.

    Args:
        request: The admitted request (its inputs dict is replaced, never mutated: the
            caller's arrays are left as they were).
        rows: Its batch-dimension size (1 for a model without batching).
    """
    if not request.parameters:
        return
    sequence_id = sequence_id_of(request.parameters)
    if sequence_id is None:
        return
    ids = np.empty(max(1, rows), dtype=object)
    ids[:] = sequence_id
    request.inputs = {**request.inputs, CORRELATION_INPUT: ids}
