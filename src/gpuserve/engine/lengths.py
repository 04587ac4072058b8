"""Length-aware batch formation: which queued requests join a leader of a given length.

Requests of text models carry a cost from their model's admission step
(:class:`~gpuserve.engine.request.RequestCost`: tokens per row). A batch is padded to its
longest row, so stacking a 10-token sentence with a 250-token chunk costs the sentence 240
tokens of padding: on a CPU that halves throughput for a realistic mix of lengths. The dynamic
batcher therefore lets a request join a batch only when the batch stays homogeneous in length,
and bounds the batch's padded tokens (rows x longest row) by ``max_batch_tokens``.

:func:`select_group` is the whole policy, a pure function: the leader (the oldest request of the
highest priority level, which always goes, so nothing starves) plus the compatible requests of
the nearest lengths, while

* the rows fit in the batch's row limit,
* the padded tokens fit in the token budget (the leader alone may exceed it: it runs alone),
* the longest row is at most :data:`LENGTH_RATIO` times the shortest plus
  :data:`LENGTH_SLACK` tokens (a few tokens of padding are cheaper than another execution).

Lengths are in the model's unit (tokens); 0 means the request carries no cost, and such
requests are grouped by arrival order as before (see :mod:`gpuserve.engine.batcher`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpuserve.engine.batch import Pending

#: A batch's longest row may be this many times its shortest (plus the slack) ...
LENGTH_RATIO = 1.3
#: ... plus this many tokens: short texts differ by a few tokens and are not worth splitting.
LENGTH_SLACK = 8

#: Default ``max_batch_tokens`` when the model's instances are on CPUs: a BERT-small
#: encoder's tokens/s on one core peaks at 256 to 512 tokens per batch (16 rows of 16-32
#: tokens, 2-4 rows of 128; a 256-token text runs fastest alone) and falls past 1024, so
#: larger batches only add latency.
CPU_BATCH_TOKENS = 512
#: Default on GPUs, where larger batches keep raising throughput (bounded by max_batch_size).
GPU_BATCH_TOKENS = 16384


@dataclass(slots=True)
class Group:
    """The requests chosen to run with a leader.

    Attributes:
        items: The leader first, then the joiners in the order they were chosen.
        rows: Sum of their rows.
        longest: Their longest row's length, tokens.
        full: True when nothing more can join: the row limit is reached, one more row would
            pass the token budget, or a compatible request of a fitting length was left out
            only because of the budget or the row limit. A full group is sent without waiting
            out the queue delay.
    """

    items: list[Pending]
    rows: int
    longest: int
    full: bool


def default_batch_tokens(on_gpu: bool) -> int:
    """``max_batch_tokens`` for a model that does not set it: :data:`GPU_BATCH_TOKENS` when any
    instance is on a GPU, else :data:`CPU_BATCH_TOKENS`."""
    return GPU_BATCH_TOKENS if on_gpu else CPU_BATCH_TOKENS


def fits_lengths(shortest: int, longest: int) -> bool:
    """Whether rows of ``shortest`` and ``longest`` tokens may share a padded batch."""
    return longest <= shortest * LENGTH_RATIO + LENGTH_SLACK


def select_group(
    head: Pending,
    candidates: Iterable[Pending],
    row_limit: int,
    max_tokens: int | None,
    unpadded: bool = False,
) -> Group:
    """The leader ``head`` and the candidates that join it.

    Args:
        head: The leader; always in the group, even when it alone exceeds the budget.
        candidates: Other queued requests with the leader's shape key, in priority then
            arrival order (that order breaks ties between equally near lengths).
        row_limit: Most rows in the batch (``max_batch_size`` or the adaptive cap), >= 1.
        max_tokens: Most tokens in the batch: padded tokens (rows x longest row), or real
            tokens when ``unpadded``; None = no budget.
        unpadded: The model runs batches without padding (packed sequences): lengths need
            not be alike, candidates join in their given order and the budget counts real
            tokens.

    Returns:
        The :class:`Group`; candidates are chosen nearest length first unless ``unpadded``.
    """
    alone = Group([head], head.rows, head.length, head.rows >= row_limit)
    return extend_group(alone, candidates, row_limit, max_tokens, unpadded)


def extend_group(
    group: Group,
    candidates: Iterable[Pending],
    row_limit: int,
    max_tokens: int | None,
    unpadded: bool = False,
) -> Group:
    """``group`` (its leader first) joined by more of ``candidates``, chosen as
    :func:`select_group` chooses: the batcher adds bulk rows to the interactive rows this
    way, after them and within a budget of their own. Arguments as :func:`select_group`'s;
    ``group`` itself is kept whole even when it exceeds ``max_tokens``."""
    if unpadded:
        return _extend_unpadded(group, candidates, row_limit, max_tokens)
    target = group.items[0].length
    ordered = sorted(candidates, key=lambda item: abs(item.length - target))
    items = list(group.items)
    rows = group.rows
    longest = group.longest
    shortest = min(item.length for item in items)
    full = group.full or rows >= row_limit
    for item in ordered:
        if rows >= row_limit:
            full = True
            break
        low = min(shortest, item.length)
        high = max(longest, item.length)
        if not fits_lengths(low, high):
            continue
        if rows + item.rows > row_limit or (
            max_tokens is not None and (rows + item.rows) * high > max_tokens
        ):
            full = True
            continue
        items.append(item)
        rows += item.rows
        shortest, longest = low, high
    # one more row of any length pads to at least ``longest``: past the budget, nothing fits
    no_room = max_tokens is not None and (rows + 1) * longest > max_tokens
    return Group(items, rows, longest, full or no_room or rows >= row_limit)


def _extend_unpadded(
    group: Group, candidates: Iterable[Pending], row_limit: int, max_tokens: int | None
) -> Group:
    """:func:`extend_group` for unpadded execution: arrival order, real-token budget."""
    items = list(group.items)
    rows, longest = group.rows, group.longest
    tokens = sum(item.tokens for item in items)
    full = group.full or rows >= row_limit
    for item in candidates:
        if rows >= row_limit:
            full = True
            break
        if rows + item.rows > row_limit or (
            max_tokens is not None and tokens + item.tokens > max_tokens
        ):
            full = True
            continue
        items.append(item)
        rows += item.rows
        tokens += item.tokens
        longest = max(longest, item.length)
    return Group(items, rows, longest, full or rows >= row_limit)
