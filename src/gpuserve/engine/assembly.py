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

Device hand-off (ensembles): an ensemble step's request may carry ``torch.Tensor`` inputs
and take the outputs named in its ``keep_tensors`` back as tensors. For a batch holding one
(:func:`wants_tensors`) the instance asks its backend for device outputs
(``Backend.postprocess_tensors``); :func:`split_outputs` then gives each request tensors only
for the outputs it keeps, and host arrays (converted once per batch) for the rest.
:func:`stack_inputs` concatenates tensors with ``torch.cat`` on their device. Clients only ever
see numpy arrays.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuserve.backends import tensors as _tensors
from gpuserve.config import ModelConfig
from gpuserve.config.reshape import uses_reshape
from gpuserve.datatypes import numpy_dtype
from gpuserve.engine.batch import Outputs, Pending
from gpuserve.engine.request import InferenceRequest
from gpuserve.errors import BackendError, GpuserveError

logger = logging.getLogger(__name__)

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
        shapes: Per declared output, the shape the model must return without the batch
            dimension (``-1`` any size), or None for an output with a ``reshape`` (the
            reshape at completion checks it: :class:`~gpuserve.engine.reshape.ReshapeSpec`).
        dtypes: Per declared output, its numpy dtype (None for BYTES: any bytes or str).
    """

    model: str
    names: tuple[str, ...]
    batched: bool
    shapes: tuple[tuple[int, ...] | None, ...] = ()
    dtypes: tuple[np.dtype | None, ...] = ()

    @classmethod
    def of(cls, config: ModelConfig) -> OutputSpec:
        """The spec of the model ``config`` describes."""
        outputs = config.outputs
        return cls(
            config.name or "",
            tuple(o.name for o in outputs),
            config.max_batch_size > 0,
            tuple(None if uses_reshape(o) else tuple(o.shape) for o in outputs),
            tuple(None if o.datatype == "BYTES" else numpy_dtype(o.datatype) for o in outputs),
        )


def kept_tensors(request: InferenceRequest) -> frozenset[str]:
    """The outputs ``request`` takes as device tensors (empty for a client's request)."""
    return request.keep_tensors


def wants_tensors(items: Sequence[Pending]) -> bool:
    """Whether a request of the batch takes an output as a device tensor: the instance then
    calls ``Backend.postprocess_tensors`` instead of ``postprocess``."""
    for item in items:  # a loop, not any(genexpr): this runs for every batch
        request = item.request
        if request.keep_tensors:
            return True
    return False


def request_rows(request: InferenceRequest) -> int:
    """Rows of ``request`` to a model that batches: the first dimension of its (first)
    input. The protocol layer has already checked that every input agrees on it."""
    rows: int = next(iter(request.inputs.values())).shape[0]
    return rows


def shape_key(request: InferenceRequest) -> ShapeKey:
    """Non-batch shapes of ``request``'s inputs, ``((name, shape[1:]), ...)``: only requests with
    equal keys are stacked into one batch."""
    inputs = request.inputs
    if len(inputs) == 1:  # the common case, without a comprehension's frame
        for name, array in inputs.items():
            return ((name, tuple(array.shape[1:])),)
    return tuple([(name, tuple(array.shape[1:])) for name, array in inputs.items()])


def stack_inputs(items: Sequence[Pending]) -> dict[str, np.ndarray]:
    """The batch's inputs: each input of every item concatenated along axis 0, in item order.

    Args:
        items: At least one request; all have the same input names and non-batch shapes (the
            batcher groups by :func:`shape_key`).

    Returns:
        Input name -> array of ``sum(rows)`` rows (same dtype as the requests'). A batch of one
        request gets that request's own arrays, not copies. An input that some request holds
        as a ``torch.Tensor`` (handed on by an ensemble step) is a tensor on that tensor's
        device (``torch.cat``; numpy parts are copied onto it): only backends that
        ``takes_tensors`` are given such requests.
    """
    first = items[0].request.inputs
    if len(items) == 1:
        return first
    stacked: dict[str, Any] = {}
    for name in first:
        parts = [item.request.inputs[name] for item in items]
        for part in parts:  # a loop, not all(genexpr): this runs for every batch
            if type(part) is not np.ndarray:
                stacked[name] = _tensors.concat(parts)
                break
        else:
            stacked[name] = np.concatenate(parts, axis=0)
    return stacked


def check_outputs(spec: OutputSpec, outputs: dict[str, Any], rows: int) -> None:
    """Check ``outputs`` against the model's declared outputs: every one present, each with
    ``rows`` rows (a batching model), its declared shape (``-1`` any size) and datatype. A
    numpy output of another datatype is converted in place when every value survives the
    conversion exactly (an int64 array of small ints for INT32, float64 that float32 holds
    exactly), and refused otherwise.

    Raises:
        OutputMismatch: an output is missing, is a scalar, has another number of rows,
            another shape (naming the model, the output, the shape received and the one
            declared, batch dimension first) or a datatype it cannot be converted from.
    """
    missing = [name for name in spec.names if name not in outputs]
    if missing:
        raise OutputMismatch(
            f"model '{spec.model}' did not return output(s) {missing}; "
            f"it returned {sorted(outputs)}"
        )
    batched = spec.batched
    checks = zip(spec.names, spec.shapes, spec.dtypes, strict=False) if spec.shapes else ()
    for name, declared, dtype in checks:
        array = outputs[name]
        shape = array.shape
        if batched:
            got = shape[0] if len(shape) else None
            if got != rows:
                got_text = "a scalar" if got is None else f"{got} rows"
                raise OutputMismatch(
                    f"model '{spec.model}' returned {got_text} in output '{name}' "
                    f"for a batch of {rows} rows"
                )
            rest = shape[1:]
        else:
            rest = shape
        if declared is not None and not _fits(rest, declared):
            raise _shape_mismatch(spec, name, tuple(shape), declared)
        if dtype is not None and type(array) is np.ndarray and array.dtype != dtype:
            outputs[name] = _converted(spec, name, array, dtype)
    if not spec.shapes and batched:  # a spec without declared shapes: rows only
        for name in spec.names:
            array = outputs[name]
            got = array.shape[0] if array.ndim else None
            if got != rows:
                got_text = "a scalar" if got is None else f"{got} rows"
                raise OutputMismatch(
                    f"model '{spec.model}' returned {got_text} in output '{name}' "
                    f"for a batch of {rows} rows"
                )


def check_sent(spec: OutputSpec, outputs: dict[str, Any]) -> None:
    """Check the outputs of one response a decoupled model sent: each one it sent has its
    declared shape (any number of rows when the model batches) and datatype (converted in
    place when exact, as :func:`check_outputs`); a response may carry a subset.

    Raises:
        OutputMismatch: as :func:`check_outputs`.
    """
    for name, declared, dtype in zip(spec.names, spec.shapes, spec.dtypes, strict=False):
        array = outputs.get(name)
        if array is None:
            continue
        shape = tuple(array.shape)
        rest = shape[1:] if spec.batched else shape
        if spec.batched and not shape:
            raise _shape_mismatch(spec, name, shape, declared or ())
        if declared is not None and not _fits(rest, declared):
            raise _shape_mismatch(spec, name, shape, declared)
        if dtype is not None and type(array) is np.ndarray and array.dtype != dtype:
            outputs[name] = _converted(spec, name, array, dtype)


def _fits(shape: Sequence[int], declared: tuple[int, ...]) -> bool:
    """Whether ``shape`` is ``declared`` (``-1``: any size)."""
    if shape == declared:  # the common case, one tuple comparison
        return True
    return len(shape) == len(declared) and all(
        d == -1 or d == n for d, n in zip(declared, shape, strict=True)
    )


def _shape_mismatch(
    spec: OutputSpec, name: str, shape: tuple[int, ...], declared: tuple[int, ...]
) -> OutputMismatch:
    expected = [-1, *declared] if spec.batched else list(declared)
    error = OutputMismatch(
        f"model '{spec.model}' returned output '{name}' of shape {list(shape)}; "
        f"its config declares {expected}"
    )
    logger.error("%s", error.message)
    return error


def _converted(spec: OutputSpec, name: str, array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``array`` as ``dtype`` when the conversion keeps every value; else OutputMismatch."""
    try:
        with np.errstate(all="ignore"):
            converted = array.astype(dtype)
            exact = array.dtype.kind not in "OSUV" and np.array_equal(
                converted.astype(array.dtype), array, equal_nan=array.dtype.kind in "fc"
            )
    except (TypeError, ValueError):
        exact = False
    if not exact:
        error = OutputMismatch(
            f"model '{spec.model}' returned output '{name}' as {array.dtype}; its config "
            f"declares {dtype} and the values do not convert exactly"
        )
        logger.error("%s", error.message)
        raise error
    return converted


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
        arrays themselves. Tensor outputs (``Backend.postprocess_tensors``) stay tensors for
        the outputs a request keeps (:func:`kept_tensors`); every other request gets them as
        numpy arrays, each output moved to the host once for the whole batch.
    """
    if any(type(value) is not np.ndarray for value in outputs.values()):
        outputs = _HostOnDemand(outputs)
    results: list[Outputs | GpuserveError] = []
    whole = len(items) == 1
    on_demand = outputs if isinstance(outputs, _HostOnDemand) else None
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
        if on_demand is not None:
            results.append(on_demand.rows(names, kept_tensors(item.request), offset, end, whole))
        elif whole:
            results.append({name: outputs[name] for name in names})
        else:
            results.append({name: outputs[name][offset:end] for name in names})
        offset = end
    return results


class _HostOnDemand(dict):  # type: ignore[type-arg]
    """A batch's outputs, some of them tensors: each tensor converted to a host array at
    most once, for the first request that needs host data."""

    def __init__(self, outputs: Mapping[str, Any]) -> None:
        super().__init__(outputs)
        self._host: dict[str, np.ndarray] = {}

    def host(self, name: str) -> Any:
        value = self[name]
        if not _tensors.is_tensor(value):
            return value
        array = self._host.get(name)
        if array is None:
            array = self._host[name] = _tensors.to_host(value)
        return array

    def rows(
        self, names: Sequence[str], keep: frozenset[str], start: int, end: int, whole: bool
    ) -> Outputs:
        """One request's outputs: rows ``start:end`` (all of them when ``whole``), tensors for
        the names in ``keep``, host arrays for the others."""
        picked: Outputs = {}
        for name in names:
            value = self[name] if name in keep else self.host(name)
            picked[name] = value if whole else value[start:end]
        return picked


def row_error(spec: OutputSpec, row: int, error: object) -> GpuserveError:
    """The error a request gets for its failed ``row`` (index within the request): ``error``
    itself when it is a gpuserve error (its status is kept), else a BackendError quoting it."""
    if isinstance(error, GpuserveError):
        return error
    return BackendError(f"model '{spec.model}' failed on row {row} of the request: {error}")
