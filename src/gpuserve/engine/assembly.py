"""Batch assembly as pure functions: count rows, stack inputs, check and split outputs.

An instance runs, per batch::

    inputs = stack_inputs(batch.items)          # before the backend's preprocess
    ...                                         # preprocess, forward, postprocess
    check_outputs(spec, outputs, batch.rows)    # raises OutputMismatch
    results = split_outputs(spec, batch.items, outputs)

Arrays are numpy arrays with the batch dimension first when the model batches
(``max_batch_size > 0``); BYTES tensors are ``object`` arrays of ``bytes``. A request's row
count is computed once, at admission (:func:`request_rows`, kept in ``Pending.rows``); the
split uses it instead of looking at the arrays again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gpuserve.config import ModelConfig
from gpuserve.engine.batch import Outputs, Pending
from gpuserve.engine.request import InferenceRequest
from gpuserve.errors import BackendError, GpuserveError

#: Non-batch shape of every input, by name: requests with equal keys can share a batch.
ShapeKey = tuple[tuple[str, tuple[int, ...]], ...]


class OutputMismatch(BackendError):
    """The model's outputs do not fit the batch (an output missing, or the wrong number of
    rows). That is the model's bug on any batch, so splitting the batch cannot cure it: the
    scheduler fails every member instead of retrying halves."""


@dataclass(slots=True, frozen=True)
class OutputSpec:
    """What the output checks and the split need to know of a model.

    Attributes:
        model: The model's name, for error messages.
        names: Declared output names, in config order: what a request gets when it names none.
        batched: Whether the model batches (``max_batch_size > 0``): outputs then have the batch
            dimension first and are split by rows; otherwise the one request gets them whole.
    """

    model: str
    names: tuple[str, ...]
    batched: bool

    @classmethod
    def of(cls, config: ModelConfig) -> OutputSpec:
        """The spec of the model ``config`` describes."""
        return cls(
            config.name or "", tuple(o.name for o in config.outputs), config.max_batch_size > 0
        )


def request_rows(request: InferenceRequest, batched: bool) -> int:
    """Rows of ``request``: the first dimension of its (first) input when the model batches,
    else 1. The protocol layer has already checked that every input agrees on it."""
    if not batched:
        return 1
    rows: int = next(iter(request.inputs.values())).shape[0]
    return rows


def shape_key(request: InferenceRequest) -> ShapeKey:
    """Non-batch shapes of ``request``'s inputs, ``((name, shape[1:]), ...)``: only requests with
    equal keys are stacked into one batch."""
    return tuple([(name, array.shape[1:]) for name, array in request.inputs.items()])


def stack_inputs(items: Sequence[Pending]) -> dict[str, np.ndarray]:
    """The batch's inputs: each input of every item concatenated along axis 0, in item order.

    Args:
        items: At least one request; all have the same input names and non-batch shapes (the
            batcher groups by :func:`shape_key`).

    Returns:
        Input name -> array of ``sum(rows)`` rows (same dtype as the requests'). A batch of one
        request gets that request's own arrays, not copies.
    """
    first = items[0].request.inputs
    if len(items) == 1:
        return first
    return {
        name: np.concatenate([item.request.inputs[name] for item in items], axis=0)
        for name in first
    }


def check_outputs(spec: OutputSpec, outputs: Mapping[str, np.ndarray], rows: int) -> None:
    """Check that ``outputs`` holds every declared output and, for a batching model, ``rows``
    rows in each.

    Raises:
        OutputMismatch: an output is missing, is a scalar, or has another number of rows.
    """
    missing = [name for name in spec.names if name not in outputs]
    if missing:
        raise OutputMismatch(
            f"model '{spec.model}' did not return output(s) {missing}; "
            f"it returned {sorted(outputs)}"
        )
    if not spec.batched:
        return
    for name in spec.names:
        array = outputs[name]
        got = array.shape[0] if array.ndim else None
        if got != rows:
            got_text = "a scalar" if got is None else f"{got} rows"
            raise OutputMismatch(
                f"model '{spec.model}' returned {got_text} in output '{name}' "
                f"for a batch of {rows} rows"
            )


def split_outputs(
    spec: OutputSpec,
    items: Sequence[Pending],
    outputs: Mapping[str, np.ndarray],
    row_errors: Mapping[int, object] | None = None,
) -> list[Outputs | GpuserveError]:
    """Give each request its own rows of ``outputs`` (already checked by :func:`check_outputs`).

    Args:
        spec: The model's outputs.
        items: The batch's requests, in stacking order; ``item.rows`` rows each.
        outputs: Output name -> array of the batch's rows.
        row_errors: Batch row index -> error of that row (from a backend's ``RowErrors``); a
            request owning a failed row gets that row's error (:func:`row_error`) instead of
            outputs.

    Returns:
        Per item, in order: the requested outputs (``request.requested_outputs``, or every
        declared one) as views of its rows, or its error. A batch of one request gets the
        arrays themselves.
    """
    results: list[Outputs | GpuserveError] = []
    whole = len(items) == 1
    offset = 0
    for item in items:
        names = item.request.requested_outputs or spec.names
        end = offset + item.rows
        if row_errors:
            failed = [row for row in range(offset, end) if row in row_errors]
            if failed:
                results.append(row_error(spec, failed[0] - offset, row_errors[failed[0]]))
                offset = end
                continue
        if whole:
            results.append({name: outputs[name] for name in names})
        else:
            results.append({name: outputs[name][offset:end] for name in names})
        offset = end
    return results


def row_error(spec: OutputSpec, row: int, error: object) -> GpuserveError:
    """The error a request gets for its failed ``row`` (index within the request): ``error``
    itself when it is a gpuserve error (its status is kept), else a BackendError quoting it."""
    if isinstance(error, GpuserveError):
        return error
    return BackendError(f"model '{spec.model}' failed on row {row} of the request: {error}")
