"""Which CPU execution runs a batch of the text embedding model: ONNX Runtime or torch packed,
chosen by batch size from times measured at load.

The two executions compute the same embeddings (within 3e-7) at different costs, and which is
cheaper depends on the CPU and the batch. ONNX Runtime runs one sentence with the least
overhead; a batch of sentences of different lengths runs on it as padded sub-batches of
similar lengths (:func:`~gpuserve.models.bert_onnx.length_groups`), while torch runs it
packed, every projection on real tokens only. Measured in-process on one core, random batches
of short sentences (``benchmarks/mixed_length.py``'s in-process modes): on an AVX2 core ONNX
Runtime is ahead at every batch size; on a core with AMX and AVX-512 BF16, torch packed is
ahead from about 4 rows (1.1x at 32) and ONNX Runtime at 1 row (1.5x). So the CPU decides,
and it is asked: :func:`torch_from_rows` times both executions on sample batches of growing
size and returns the smallest size from which torch packed is faster by a margin at that size
and every larger one, or None (ONNX Runtime everywhere).

The decision is a pure function of the measured times (tests pass made-up ones); the
measurement (:func:`measure_executions`) runs each size on both executions in interleaved
rounds and keeps the fastest time of each, which a busy machine distorts least.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: Batch sizes measured at load, rows.
SIZES = (2, 4, 8, 16)
#: Rounds of each size on each execution; the fastest time of each is kept.
ROUNDS = 3
#: Torch packed must take at most this share of ONNX Runtime's time to be chosen: noise, or
#: a difference too small to be real, leaves ONNX Runtime in place.
MARGIN = 0.9

#: Sentences of varied lengths (8 to ~45 tokens), cycled to fill the sample batches.
SAMPLE_TEXTS = (
    "A batch of short requests.",
    "The server joins requests that arrive together into one batch for the model.",
    "Each row keeps its own length.",
    "Sentences of different lengths would waste compute if every row were padded to the "
    "longest one, so the encoder runs them packed, back to back, or in groups of similar "
    "lengths.",
    "Embeddings are unit vectors.",
    "An inference server answers over HTTP and gRPC, with dynamic batching, metrics, and "
    "versions of each model that can be rolled back.",
    "Short.",
    "The queue delay lets concurrent requests meet in one batch while the instance is busy "
    "with the previous one.",
)


@dataclass(frozen=True, slots=True)
class ExecutionTimes:
    """Fastest measured time of one sample batch per size on each execution.

    Attributes:
        sizes: Batch sizes, rows, ascending.
        onnxruntime_s: Seconds per batch on ONNX Runtime, one per size.
        torch_s: Seconds per batch on torch packed, one per size.
    """

    sizes: tuple[int, ...]
    onnxruntime_s: tuple[float, ...]
    torch_s: tuple[float, ...]

    def describe(self) -> str:
        """``rows: ort ms / torch ms`` per size, for the load log."""
        return ", ".join(
            f"{n} rows {o * 1e3:.1f}/{t * 1e3:.1f} ms"
            for n, o, t in zip(self.sizes, self.onnxruntime_s, self.torch_s, strict=True)
        )


def torch_from_rows(times: ExecutionTimes, margin: float = MARGIN) -> int | None:
    """The smallest measured batch size from which torch packed takes at most ``margin`` x
    ONNX Runtime's time, at that size and at every larger one; None when the largest size
    does not qualify (ONNX Runtime runs every batch)."""
    chosen: int | None = None
    for size, ort_s, torch_s in zip(
        reversed(times.sizes), reversed(times.onnxruntime_s), reversed(times.torch_s), strict=True
    ):
        if torch_s > margin * ort_s:
            break
        chosen = size
    return chosen


def measure_executions(
    run_onnxruntime: Callable[[Sequence[str]], object],
    run_torch: Callable[[Sequence[str]], object],
    sizes: Sequence[int] = SIZES,
    rounds: int = ROUNDS,
    clock: Callable[[], float] = time.perf_counter,
) -> ExecutionTimes:
    """Time both executions on sample batches of each size (:data:`SAMPLE_TEXTS` cycled).

    Args:
        run_onnxruntime: Embeds a list of texts on ONNX Runtime (tokenisation included).
        run_torch: The same on torch packed.
        sizes: Batch sizes, rows, ascending.
        rounds: Interleaved rounds; the fastest time of each (size, execution) is kept.
        clock: Seconds, monotonic.
    """
    batches = [[SAMPLE_TEXTS[(k * 3 + n) % len(SAMPLE_TEXTS)] for k in range(n)] for n in sizes]
    best: dict[tuple[int, int], float] = {}
    for run in (run_onnxruntime, run_torch):  # one warm-up pass: allocators, kernels
        for batch in batches:
            run(batch)
    for _ in range(rounds):
        for index, batch in enumerate(batches):
            for which, run in enumerate((run_onnxruntime, run_torch)):
                start = clock()
                run(batch)
                took = clock() - start
                key = (index, which)
                best[key] = min(best.get(key, took), took)
    return ExecutionTimes(
        tuple(sizes),
        tuple(best[(i, 0)] for i in range(len(sizes))),
        tuple(best[(i, 1)] for i in range(len(sizes))),
    )


__all__ = [
    "MARGIN",
    "SAMPLE_TEXTS",
    "SIZES",
    "ExecutionTimes",
    "measure_executions",
    "torch_from_rows",
]
