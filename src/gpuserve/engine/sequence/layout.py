"""The slot layout of a ``direct`` sequence batch: pure helpers of the sequence batcher.

With Triton's ``direct`` strategy every sequence holds one batch slot of one instance for its
life, and the batch the model executes is laid out by slot: row ``i`` is slot ``i``. A batch
runs rows ``0..h``, ``h`` being the highest slot with a request in this execution (as
Triton's direct batcher sends them); a slot in between with no request in it (no sequence, or
its sequence has nothing ready, or its request's shapes differ from the batch's) is a
*filler row*. So a model that keeps its own per-slot state indexed by row position (a Triton
C++ backend, a Python model written for Triton) finds each sequence at the same row every
time.

A filler row is built as Triton builds its "null" request: inputs of the same datatypes and
shapes as the batch's other rows, zeros (``b""`` for BYTES); control inputs START, END and
READY false and CORRID 0 (a model must not read a not-ready row's other inputs); implicit
states zeros, a dummy that never replaces any sequence's state. Its outputs are dropped after
the batch ran: nobody gets them, and it is no request in statistics (only the executed batch
size, ``Batch.rows``, counts it, as Triton's ``batch_stats`` does).

Arrays have one row: ``[1, ...]`` (filler rows only exist for models with ``max_batch_size >
0``: a model without batching has one slot per instance).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from gpuserve.config.sequence import ControlInput
from gpuserve.engine.batch import BatchResult, Pending
from gpuserve.engine.request import InferenceRequest
from gpuserve.engine.sequence.tensors import SequenceFlags, control_array

__all__ = ["FillerRow", "FillerRows", "drop_fillers", "slot_rows"]

#: The flags a filler row's controls carry: not starting, not ending (READY is false apart).
_NOT_READY = SequenceFlags(0, start=False, end=False)

#: Filler requests remembered (one per distinct batch shape); beyond it the cache restarts.
_CACHED = 64


@dataclass(slots=True, eq=False)
class FillerRow(Pending):
    """A row of a ``direct`` batch whose slot has no request in this execution.

    Attributes:
        slot: The slot (row index) it fills.
    """

    slot: int = 0


class FillerRows:
    """Makes the filler rows of one sequence model's ``direct`` batches.

    Args:
        model: The model's name (the filler requests carry it).
        controls: The model's control inputs (filled with their not-ready values).
    """

    def __init__(self, model: str, controls: Sequence[ControlInput]) -> None:
        self.model = model
        self.controls = {control.name: control for control in controls}
        self._requests: dict[Hashable, InferenceRequest] = {}

    def request(self, template: InferenceRequest, key: Hashable) -> InferenceRequest:
        """A filler request shaped like ``template`` (a request of the batch, its control
        and state inputs already added): same input names, datatypes and row shapes.

        Args:
            template: A request of the batch.
            key: What determines the template's shapes (the batch's grouping key); requests
                are cached by it, and shared: their arrays are read-only.
        """
        cached = self._requests.get(key)
        if cached is not None:
            return cached
        inputs: dict[str, np.ndarray] = {}
        for name, array in template.inputs.items():
            control = self.controls.get(name)
            if control is not None:
                value = control_array(control, _NOT_READY, batched=True)
                if control.kind == "ready":
                    value = np.full_like(value, control.values[0])
                elif control.kind == "corrid" and value.dtype == object:
                    value = np.full(value.shape, b"", dtype=object)
            elif array.dtype == object:
                value = np.full((1, *array.shape[1:]), b"", dtype=object)
            else:
                value = np.zeros((1, *array.shape[1:]), dtype=array.dtype)
            value.flags.writeable = False
            inputs[name] = value
        request = InferenceRequest(self.model, None, inputs, requested_outputs=None)
        if len(self._requests) >= _CACHED:
            self._requests.clear()
        self._requests[key] = request
        return request


def slot_rows(
    by_slot: dict[int, Pending], filler: InferenceRequest, formed_s: float
) -> list[Pending]:
    """The rows of a ``direct`` batch in slot order: slots ``0..max(by_slot)``, each the
    request that occupies it or a :class:`FillerRow` of ``filler``.

    Args:
        by_slot: Slot -> the request that runs in it now (at least one).
        filler: The filler request (from :meth:`FillerRows.request`).
        formed_s: The batch's formation time, seconds (the filler rows' arrival).
    """
    rows: list[Pending] = []
    for slot in range(max(by_slot) + 1):
        item = by_slot.get(slot)
        rows.append(item if item is not None else FillerRow(filler, 1, (), formed_s, slot=slot))
    return rows


def drop_fillers(result: BatchResult) -> None:
    """Remove the filler rows from ``result.batch.items`` and their outputs (or row errors)
    from ``result.results``, in place; ``batch.rows`` keeps the executed size."""
    items = result.batch.items
    if not any(type(item) is FillerRow for item in items):
        return
    keep = [index for index, item in enumerate(items) if type(item) is not FillerRow]
    if len(result.results) == len(items):
        result.results = [result.results[index] for index in keep]
    result.batch.items = [items[index] for index in keep]
