"""``gpuserve tune --accuracy-budget``: which precisions the search may choose.

Before the search, every precision of the search space is measured against fp32 on the
held-out sentences (:mod:`gpuserve.bench.accuracy`; fp32 itself needs no measurement); a
precision past the budget is left out of the search, and the report shows each precision's
speed against its accuracy. The tuned config carries the budget as its ``precision_check``
bounds, so the version it describes passes its own load-time gate.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuserve.backends.precision_gate import AccuracyReport

#: Measures precisions (never fp32) against fp32: the tuner's injectable accuracy probe.
AccuracyProbe = Callable[[Sequence[str]], list[AccuracyReport]]

_KEYS = {
    "cosine": "min_cosine",
    "min_cosine": "min_cosine",
    "recall": "min_recall",
    "recall@10": "min_recall",
    "min_recall": "min_recall",
    "abs": "max_abs_error",
    "max_abs_error": "max_abs_error",
}


@dataclass(frozen=True, slots=True)
class AccuracyBudget:
    """The least accuracy a chosen precision keeps against fp32 (held-out set).

    Attributes:
        min_cosine: Smallest per-text cosine similarity, or None (unbounded).
        min_recall: Smallest recall@10 of nearest neighbours, or None.
        max_abs_error: Largest absolute difference of one output value, or None.
    """

    min_cosine: float | None = None
    min_recall: float | None = None
    max_abs_error: float | None = None

    def problem(self, report: AccuracyReport) -> str | None:
        """Which bound ``report`` breaks (one phrase), or None when it is within budget."""
        broken = []
        if self.min_cosine is not None and report.cosine_min < self.min_cosine:
            broken.append(f"min cosine {report.cosine_min:.6f} < {self.min_cosine!r}")
        if self.min_recall is not None and report.recall_at_k < self.min_recall:
            broken.append(f"recall@{report.k} {report.recall_at_k:.4f} < {self.min_recall!r}")
        if self.max_abs_error is not None and report.max_abs_error > self.max_abs_error:
            broken.append(f"max abs error {report.max_abs_error:.6f} > {self.max_abs_error!r}")
        return "; ".join(broken) or None

    def label(self) -> str:
        parts = []
        if self.min_cosine is not None:
            parts.append(f"cosine>={self.min_cosine:g}")
        if self.min_recall is not None:
            parts.append(f"recall@10>={self.min_recall:g}")
        if self.max_abs_error is not None:
            parts.append(f"abs<={self.max_abs_error:g}")
        return ",".join(parts)

    def precision_check(self) -> dict[str, float]:
        """The ``precision_check`` bounds of a config tuned within this budget."""
        out: dict[str, float] = {}
        if self.min_cosine is not None:
            out["min_cosine"] = self.min_cosine
        if self.min_recall is not None:
            out["min_neighbour_recall"] = self.min_recall
        if self.max_abs_error is not None:
            out["max_abs_error"] = self.max_abs_error
        return out


def parse_accuracy_budget(text: str) -> AccuracyBudget:
    """``cosine=0.99,recall=0.95[,abs=0.05]`` -> :class:`AccuracyBudget`.

    Raises:
        ValueError: an unknown key, a value that is not a number or out of range.
    """
    values: dict[str, float] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, raw = item.partition("=")
        field = _KEYS.get(key.strip().lower())
        if not sep or field is None:
            raise ValueError(
                f"--accuracy-budget {item!r}: expected cosine=X, recall=X or abs=X "
                "(e.g. cosine=0.99,recall=0.95)"
            )
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"--accuracy-budget {item!r}: {raw!r} is not a number") from None
        if field != "max_abs_error" and not -1.0 <= value <= 1.0:
            raise ValueError(f"--accuracy-budget {item!r}: expected a value in [-1, 1]")
        if field == "max_abs_error" and value < 0:
            raise ValueError(f"--accuracy-budget {item!r}: expected a value >= 0")
        values[field] = value
    if not values:
        raise ValueError("--accuracy-budget: no bound given (e.g. cosine=0.99,recall=0.95)")
    return AccuracyBudget(**values)


def heldout_probe(model_dir: Path, texts_path: Path | None = None) -> AccuracyProbe:
    """The probe of ``gpuserve models accuracy``: the model in-process on the CPU."""

    def probe(precisions: Sequence[str]) -> list[AccuracyReport]:
        from gpuserve.bench.accuracy import heldout_texts, measure_accuracy

        return measure_accuracy(model_dir, list(precisions), heldout_texts(texts_path))

    return probe
