"""The accuracy of a lower precision against fp32, and the gate a version passes at load.

Pure numpy: :func:`compare` measures two sets of embeddings of the same texts (the
configured precision and fp32); :func:`gate_problem` holds the measurement against the
``precision_check`` bounds and says, in one sentence, which bound failed and by how much.
The same measurement backs ``gpuserve models accuracy`` and ``gpuserve tune
--accuracy-budget`` (on a held-out set, never the gate's reference set).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from gpuserve.config.precision import PrecisionCheckConfig

#: Built-in reference texts of the gate (package data, one sentence a line).
REFERENCE_RESOURCE = "reference_sentences.txt"
#: Built-in held-out texts of ``gpuserve models accuracy`` (disjoint from the reference).
HELDOUT_RESOURCE = "heldout_sentences.txt"


@dataclass(frozen=True, slots=True)
class AccuracyReport:
    """A precision's embeddings against fp32's, for the same N texts.

    Attributes:
        precision: The precision measured (``bf16``, ``int8``, ...).
        texts: N.
        cosine_min: Smallest per-text cosine similarity to fp32.
        cosine_mean: Mean per-text cosine similarity.
        max_abs_error: Largest |value - fp32 value| over all N x H outputs.
        recall_at_k: Mean over texts of |kNN(precision) & kNN(fp32)| / k, neighbours by
            cosine within the N texts (the text itself left out).
        k: Neighbours per text (``min(requested, N - 1)``).
    """

    precision: str
    texts: int
    cosine_min: float
    cosine_mean: float
    max_abs_error: float
    recall_at_k: float
    k: int

    def as_dict(self) -> dict[str, float | int | str]:
        """JSON-ready fields."""
        return asdict(self)

    def line(self) -> str:
        """One human line: ``bf16: cosine min 0.9999 mean 1.0000, max |err| 0.0021, ...``."""
        return (
            f"{self.precision}: cosine min {self.cosine_min:.4f} mean {self.cosine_mean:.4f}, "
            f"max abs error {self.max_abs_error:.4f}, recall@{self.k} {self.recall_at_k:.3f} "
            f"({self.texts} texts)"
        )


def _unit(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.where(norms == 0.0, 1.0, norms)


def neighbours(rows: np.ndarray, k: int) -> np.ndarray:
    """int64 [N, k]: each row's k nearest other rows by cosine (float [N, H] in)."""
    unit = _unit(rows.astype(np.float64))
    sim = unit @ unit.T
    np.fill_diagonal(sim, -np.inf)
    # a stable sort: ties fall the same way for both precisions
    return np.argsort(-sim, axis=1, kind="stable")[:, :k]


def compare(
    precision: str, candidate: np.ndarray, reference: np.ndarray, k: int = 10
) -> AccuracyReport:
    """Measure ``candidate`` (float [N, H], the precision) against ``reference`` (fp32).

    Raises:
        ValueError: shapes differ, or fewer than 2 texts.
    """
    if candidate.shape != reference.shape or candidate.ndim != 2:
        raise ValueError(
            f"embeddings of shape {candidate.shape} cannot be compared with {reference.shape}"
        )
    count = candidate.shape[0]
    if count < 2:
        raise ValueError(f"an accuracy check needs at least 2 texts, got {count}")
    got, want = candidate.astype(np.float64), reference.astype(np.float64)
    cosine = np.sum(_unit(got) * _unit(want), axis=1)
    k = max(1, min(k, count - 1))
    mine, theirs = neighbours(got, k), neighbours(want, k)
    recall = np.mean([len(set(a) & set(b)) / k for a, b in zip(mine.tolist(), theirs.tolist())])
    return AccuracyReport(
        precision=precision,
        texts=count,
        cosine_min=float(cosine.min()),
        cosine_mean=float(cosine.mean()),
        max_abs_error=float(np.max(np.abs(got - want))),
        recall_at_k=float(recall),
        k=k,
    )


def gate_problem(report: AccuracyReport, bounds: PrecisionCheckConfig) -> str | None:
    """Which ``precision_check`` bounds ``report`` breaks, in one sentence; None: it passes.

    Measured values carry 6 decimals (4 for recall) and bounds are written as given, so a
    bound like 0.9999999 never reads as "1" beside a measured "0.9999"."""
    broken = []
    if report.cosine_min < bounds.min_cosine:
        broken.append(f"min cosine {report.cosine_min:.6f} < min_cosine {bounds.min_cosine!r}")
    if report.max_abs_error > bounds.max_abs_error:
        broken.append(
            f"max abs error {report.max_abs_error:.6f} > max_abs_error {bounds.max_abs_error!r}"
        )
    if report.recall_at_k < bounds.min_neighbour_recall:
        broken.append(
            f"recall@{report.k} {report.recall_at_k:.4f} < min_neighbour_recall "
            f"{bounds.min_neighbour_recall!r}"
        )
    if not broken:
        return None
    return (
        f"precision {report.precision} fails precision_check against fp32 on "
        f"{report.texts} reference texts: {'; '.join(broken)}"
    )


def reference_texts(
    bounds: PrecisionCheckConfig, version_path: Path, minimum: int = 1
) -> tuple[list[str], str]:
    """The gate's reference texts (one a line; :data:`REFERENCE_RESOURCE` unless
    ``reference_file`` names a file of the version folder) and where they came from.

    Raises:
        ValueError: ``reference_file`` unreadable or with fewer than ``minimum`` texts.
    """
    if bounds.reference_file is None:
        return builtin_texts(REFERENCE_RESOURCE), "built-in reference sentences"
    path = version_path / bounds.reference_file
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise ValueError(f"precision_check.reference_file: cannot read {path}: {err}") from None
    texts = [line.strip() for line in lines if line.strip()]
    if len(texts) < minimum:
        raise ValueError(
            f"precision_check.reference_file: {path} has {len(texts)} texts; "
            f"expected at least {minimum}"
        )
    return texts, str(path)


def builtin_texts(resource: str) -> list[str]:
    """The lines of a built-in text file (:data:`REFERENCE_RESOURCE`, :data:`HELDOUT_RESOURCE`)."""
    text = resources.files("gpuserve.text.data").joinpath(resource).read_text(encoding="utf-8")
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]
