"""A batch's row contexts (:class:`~gpuserve.backends.row_context.RowContext`), from its
requests.

A request's context is read from what admission left on it: its id, its ``sequence_id`` and
``sequence_start`` / ``sequence_end`` parameters (Triton's ``correlation_id()`` and
``flags()``), how long its caller waits, its cancellation probe and its trace. The same
request gives the same context whether it came from a client, an ensemble step (which passes
its request's parameters on) or a BLS call (whose ``correlation_id`` and ``flags`` become
those parameters).

:class:`BatchRows` builds them on first use: a batch whose model reads no context and makes
no call costs nothing here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

from gpuserve.backends.row_context import RowContext
from gpuserve.backends.row_context import context_of as row_context
from gpuserve.engine.batch import Pending
from gpuserve.engine.request import InferenceRequest


def context_of(request: InferenceRequest) -> RowContext:
    """The context of ``request``'s rows."""
    return row_context(
        request.id or "",
        request.parameters,
        request.awaited_until,
        request.is_cancelled,
        request.trace,
    )


class BatchRows(Sequence[RowContext]):
    """The row contexts of a batch's items, one per row, in row order (built on first use).

    Args:
        items: The batch's requests, each with its row count.
    """

    __slots__ = ("_items", "_rows")

    def __init__(self, items: Sequence[Pending]) -> None:
        self._items = items
        self._rows: list[RowContext] | None = None

    def _built(self) -> list[RowContext]:
        rows = self._rows
        if rows is None:
            rows = []
            for item in self._items:
                context = context_of(item.request)
                rows.extend([context] * max(1, item.rows))
            self._rows = rows
        return rows

    @overload
    def __getitem__(self, index: int) -> RowContext: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[RowContext]: ...

    def __getitem__(self, index: int | slice) -> RowContext | Sequence[RowContext]:
        return self._built()[index]

    def __len__(self) -> int:
        return len(self._built())

    def __iter__(self) -> Iterator[RowContext]:
        return iter(self._built())


__all__ = ["BatchRows", "context_of"]
