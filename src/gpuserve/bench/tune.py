"""``gpuserve tune``: search a model's serving configuration for the most throughput whose p99
latency stays within a budget.

Each candidate configuration runs for real: a temporary repository holding only the model,
with the candidate's ``config.yaml`` (the version folders are linked, not copied), is served by
``gpuserve serve`` in a subprocess and measured with the bench's closed-loop concurrency sweep.
A candidate's **score** is its highest throughput (rows/s) at a concurrency whose p99 is within
the budget and that saw no errors; the sweep stops at the first concurrency over the budget,
then tries the midpoint between the last level within it and that one.

The search is coordinate descent (hill climbing), not a grid: starting from the model's current
configuration it changes one setting at a time, in the order max_batch_size, max_queue_delay_us,
instance count, preferred_batch_sizes, precision, adaptive batching; along an ordered setting
it keeps stepping in a direction while the score improves by more than ``min_gain``. Passes
repeat until nothing improves or the time budget is spent. Finally the best few are measured
again (confirmation, the successive-halving idea: only survivors get more measurement) and
the winner is the best mean; the current configuration stays unless something beats it.

With an accuracy budget (:mod:`gpuserve.bench.tune_accuracy`) the precisions are measured
against fp32 first, and only those within the budget enter the search.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from gpuserve.backends.precision_gate import AccuracyReport
from gpuserve.bench.benchmark import BenchConfig, BenchResult, run_benchmark
from gpuserve.bench.candidate_server import CandidateServer
from gpuserve.bench.loadgen import LevelResult, LoadSettings
from gpuserve.bench.tune_accuracy import AccuracyBudget, AccuracyProbe, heldout_probe
from gpuserve.config import CONFIG_FILENAME, ModelConfig, parse_model_config

PREFERRED_MODES = ("none", "max", "half")
DIMENSIONS = (
    "max_batch_size",
    "max_queue_delay_us",
    "instance_count",
    "preferred",
    "precision",
    "adaptive",
)
ORDERED = {"max_batch_size", "max_queue_delay_us", "instance_count"}


@dataclass(frozen=True, slots=True)
class Candidate:
    """One point of the search space.

    Attributes:
        preferred: ``none`` (no preferred sizes), ``max`` ([max_batch_size]) or ``half``
            ([max_batch_size / 2, max_batch_size]); resolved against the candidate's own
            max_batch_size so the two never conflict.
        adaptive_ms: ``dynamic_batching.adaptive.target_p99_ms``, or None for a fixed delay.
    """

    max_batch_size: int
    max_queue_delay_us: int
    instance_count: int
    preferred: str
    precision: str
    adaptive_ms: float | None = None

    def value(self, dim: str) -> Any:
        return self.adaptive_ms if dim == "adaptive" else getattr(self, dim)

    def with_value(self, dim: str, value: Any) -> Candidate:
        return replace(self, **{"adaptive_ms" if dim == "adaptive" else dim: value})

    def preferred_sizes(self) -> list[int]:
        mbs = self.max_batch_size
        if self.preferred == "max" and mbs > 1:
            return [mbs]
        if self.preferred == "half" and mbs > 1:
            return sorted({max(1, mbs // 2), mbs})
        return []

    def label(self) -> str:
        parts = [
            f"mbs={self.max_batch_size}",
            f"delay={self.max_queue_delay_us}us",
            f"inst={self.instance_count}",
            f"pref={self.preferred}",
            self.precision,
        ]
        if self.adaptive_ms is not None:
            parts.append(f"adaptive={self.adaptive_ms:g}ms")
        return " ".join(parts)

    def apply(self, data: dict[str, Any]) -> dict[str, Any]:
        """A copy of the raw config mapping ``data`` with this candidate's settings."""
        out = dict(data)
        out["max_batch_size"] = self.max_batch_size
        batching = dict(out.get("dynamic_batching") or {})
        batching["max_queue_delay_us"] = self.max_queue_delay_us
        batching["preferred_batch_sizes"] = self.preferred_sizes()
        if self.adaptive_ms is not None:
            batching["adaptive"] = {"target_p99_ms": self.adaptive_ms}
        else:
            batching.pop("adaptive", None)
        out["dynamic_batching"] = batching
        groups = [dict(g) for g in (out.get("instance_group") or [{"count": 1, "kind": "auto"}])]
        groups[0]["count"] = self.instance_count
        out["instance_group"] = groups
        out["precision"] = self.precision
        return out

    @classmethod
    def from_config(cls, config: ModelConfig) -> Candidate:
        db = config.dynamic_batching
        mbs = config.max_batch_size
        sizes = sorted(db.preferred_batch_sizes)
        if not sizes:
            preferred = "none"
        elif sizes == [mbs]:
            preferred = "max"
        else:
            preferred = "half"
        return cls(
            max_batch_size=mbs,
            max_queue_delay_us=db.max_queue_delay_us,
            instance_count=config.instance_group[0].count if config.instance_group else 1,
            preferred=preferred,
            precision=config.precision,
            adaptive_ms=db.adaptive.target_p99_ms if db.adaptive is not None else None,
        )


@dataclass
class SearchSpace:
    """Values each setting may take (the current configuration's value is always included)."""

    max_batch_size: list[int] = field(default_factory=lambda: [4, 8, 16, 32, 64, 128])
    max_queue_delay_us: list[int] = field(
        default_factory=lambda: [0, 500, 1000, 2000, 5000, 10000, 20000]
    )
    instance_count: list[int] = field(default_factory=lambda: [1, 2, 4])
    preferred: list[str] = field(default_factory=lambda: list(PREFERRED_MODES))
    precision: list[str] = field(default_factory=lambda: ["fp32", "bf16", "fp16"])
    adaptive: list[float | None] = field(default_factory=lambda: [None])

    def values(self, dim: str, current: Any) -> list[Any]:
        listed = list(getattr(self, dim))
        if current not in listed:
            listed.append(current)
        if dim in ORDERED:
            return sorted(listed)
        return listed


@dataclass
class Evaluation:
    """A measured candidate.

    Attributes:
        phase: Search step that proposed it (``baseline``, a dimension name, ``confirm``).
        levels: Every concurrency level measured, ascending.
        best: The level that gives the score, or None when none fits the budget.
        score: Rows/s of ``best`` (0 when none fits); after confirmation, the mean of runs.
        status: ``ok``, ``over budget`` or ``failed``.
        detail: Why it failed, or a note.
        seconds: Wall time spent on it, server start included.
        runs: Scores of each measurement (more than one after confirmation).
    """

    candidate: Candidate
    phase: str
    levels: list[LevelResult] = field(default_factory=list)
    best: LevelResult | None = None
    score: float = 0.0
    status: str = "ok"
    detail: str = ""
    seconds: float = 0.0
    runs: list[float] = field(default_factory=list)

    @property
    def min_p99_ms(self) -> float | None:
        values = [r.p99_ms for r in self.levels if r.summary.ok]
        return min(values) if values else None


@dataclass
class TuneSettings:
    """Knobs of the search itself.

    Attributes:
        latency_budget_ms: p99 budget a candidate must meet.
        levels: Concurrency levels of each candidate's sweep, ascending.
        load: Window settings of each level.
        budget_s: Total wall time for the search; it stops proposing candidates when the next
            would not fit (the report says so).
        min_gain: Relative improvement a change must bring to be kept (noise guard).
        max_passes: Passes of coordinate descent.
        confirm: Best candidates measured again at the end (0 = none).
        batch_size: Rows per request.
        server_args: Extra ``gpuserve serve`` arguments.
        ready_timeout_s: How long a candidate's server may take to become ready.
        server_cpus: Pin each candidate's server to these CPUs (``taskset -c`` list).
        server_env: Extra environment of each candidate's server.
    """

    latency_budget_ms: float
    levels: list[float] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    load: LoadSettings = field(
        default_factory=lambda: LoadSettings(
            warmup_s=1.0, window_s=1.5, stable_windows=3, tolerance=0.15, max_windows=5
        )
    )
    budget_s: float = 1800.0
    min_gain: float = 0.03
    max_passes: int = 2
    confirm: int = 3
    batch_size: int = 1
    server_args: list[str] = field(default_factory=list)
    ready_timeout_s: float = 300.0
    server_cpus: str | None = None
    server_env: dict[str, str] = field(default_factory=dict)


@dataclass
class TuneResult:
    model: str
    settings: TuneSettings
    baseline: Evaluation
    winner: Evaluation
    evaluations: list[Evaluation]
    elapsed_s: float
    stopped_by_budget: bool
    config: dict[str, Any]
    finalists: list[Evaluation] = field(default_factory=list)
    accuracy_budget: AccuracyBudget | None = None
    #: Each precision's accuracy against fp32 on the held-out set (with a budget).
    accuracy: dict[str, AccuracyReport] = field(default_factory=dict)
    #: Precisions left out of the search, and why.
    excluded: dict[str, str] = field(default_factory=dict)


class Tuner:
    """The search (see the module docstring).

    Args:
        model_dir: ``<repository>/<model>`` folder with the current ``config.yaml``.
        space: Values to try.
        settings: Budget and measurement settings.
        log: Called with one line per event (progress for the CLI).
        accuracy_budget: Keep only precisions within it (None: every precision).
        accuracy: Measures precisions against fp32 (default: in-process on the held-out
            sentences, see :func:`~gpuserve.bench.tune_accuracy.heldout_probe`).
    """

    def __init__(
        self,
        model_dir: Path,
        space: SearchSpace,
        settings: TuneSettings,
        log: Callable[[str], None] = print,
        accuracy_budget: AccuracyBudget | None = None,
        accuracy: AccuracyProbe | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.model = model_dir.name
        path = model_dir / CONFIG_FILENAME
        self.raw: dict[str, Any] = yaml.safe_load(path.read_text()) or {}
        self.config = parse_model_config(self.raw, path, self.model)
        if self.config.max_batch_size == 0:
            space.max_batch_size = [0]
            space.preferred = ["none"]
            space.max_queue_delay_us = [self.config.dynamic_batching.max_queue_delay_us]
            space.adaptive = [None]
        self.space = space
        self.settings = settings
        self.log = log
        self.evaluations: list[Evaluation] = []
        self._seen: dict[Candidate, Evaluation] = {}
        self._start = 0.0
        self.stopped_by_budget = False
        self.finalists: list[Evaluation] = []
        self.accuracy_budget = accuracy_budget
        self._probe = accuracy or heldout_probe(model_dir)
        self.accuracy: dict[str, AccuracyReport] = {}
        self.excluded: dict[str, str] = {}
        if accuracy_budget is not None:
            bounds = {**(self.raw.get("precision_check") or {})}
            bounds.update(accuracy_budget.precision_check())
            self.raw["precision_check"] = bounds

    # -- measuring one candidate -----------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def _fits_budget(self) -> bool:
        done = [e.seconds for e in self.evaluations if e.seconds > 0]
        estimate = sum(done) / len(done) if done else 0.0
        if self.elapsed() + estimate > self.settings.budget_s:
            self.stopped_by_budget = True
            return False
        return True

    def valid(self, candidate: Candidate) -> str | None:
        """None when ``candidate`` makes a valid config, else the reason."""
        try:
            parse_model_config(
                candidate.apply(self.raw), self.model_dir / CONFIG_FILENAME, self.model
            )
        except Exception as err:  # ConfigError: the message names the field
            return str(err).splitlines()[-1].strip()
        return None

    def measure(self, candidate: Candidate) -> tuple[list[LevelResult], str, str]:
        """Serve ``candidate`` and sweep it; returns (levels, status, detail)."""
        settings = self.settings
        budget = settings.latency_budget_ms
        with tempfile.TemporaryDirectory(prefix="gpuserve-tune-") as work:
            server = CandidateServer(
                self.model_dir,
                candidate.apply(self.raw),
                Path(work),
                settings.server_args,
                settings.server_cpus,
                settings.server_env,
            )
            try:
                server.wait_ready(settings.ready_timeout_s, self.model)
                config = BenchConfig(
                    url=server.url,
                    model=self.model,
                    levels=list(settings.levels),
                    batch_size=settings.batch_size,
                    settings=settings.load,
                )

                def over(result: LevelResult) -> bool:
                    return bool(result.summary.errors) or not result.p99_ms <= budget

                result = run_benchmark(config, stop=over)
                levels = list(result.levels)
                levels += self._bisect(config, result, over)
            except Exception as err:  # the server or the bench failed: a failed candidate
                return [], "failed", f"{type(err).__name__}: {err}"[:400]
            finally:
                server.stop()
        levels.sort(key=lambda r: r.level)
        return levels, "ok", ""

    def _bisect(self, config: BenchConfig, result: BenchResult, over: Any) -> list[LevelResult]:
        levels = result.levels
        if len(levels) < 2 or not over(levels[-1]) or over(levels[-2]):
            return []
        low, high = levels[-2].level, levels[-1].level
        mid = float(int((low + high) / 2))
        if mid <= low or mid >= high:
            return []
        extra = run_benchmark(replace(config, levels=[mid]), info=result.model)
        return list(extra.levels)

    def evaluate(self, candidate: Candidate, phase: str) -> Evaluation:
        """Measure ``candidate`` once (memoised: a candidate seen before is not re-run)."""
        if candidate in self._seen:
            return self._seen[candidate]
        evaluation = Evaluation(candidate, phase)
        reason = self.valid(candidate)
        if reason is not None:
            evaluation.status, evaluation.detail = "failed", f"invalid config: {reason}"
        else:
            started = time.monotonic()
            levels, status, detail = self.measure(candidate)
            evaluation.seconds = time.monotonic() - started
            evaluation.levels, evaluation.status, evaluation.detail = levels, status, detail
            self._score(evaluation)
        self._seen[candidate] = evaluation
        self.evaluations.append(evaluation)
        self.log(self._line(evaluation))
        return evaluation

    def _score(self, evaluation: Evaluation) -> None:
        budget = self.settings.latency_budget_ms
        fits = [
            r for r in evaluation.levels
            if r.summary.ok and not r.summary.errors and r.p99_ms <= budget
        ]  # fmt: skip
        if evaluation.status != "ok":
            return
        if not fits:
            evaluation.status = "over budget"
            low = evaluation.min_p99_ms
            evaluation.detail = (
                f"p99 {low:.1f} ms at best > {budget:g} ms" if low is not None else "no success"
            )
            return
        evaluation.best = max(fits, key=lambda r: r.throughput * r.batch_size)
        evaluation.score = evaluation.best.throughput * evaluation.best.batch_size
        evaluation.runs.append(evaluation.score)

    def _line(self, e: Evaluation) -> str:
        head = f"[{self.elapsed():6.0f}s] {e.phase:>18}: {e.candidate.label():<60}"
        if e.best is not None:
            return (
                f"{head} {e.score:8.1f} rows/s at c={e.best.level:g} (p99 {e.best.p99_ms:.1f} ms)"
            )
        return f"{head} {e.status}: {e.detail}"

    # -- the search ------------------------------------------------------------------------

    def _better(self, challenger: Evaluation, incumbent: Evaluation) -> bool:
        return challenger.score > incumbent.score * (1 + self.settings.min_gain)

    def _climb(self, incumbent: Evaluation, dim: str) -> Evaluation:
        current = incumbent.candidate.value(dim)
        values = self.space.values(dim, current)
        if dim not in ORDERED:
            best = incumbent
            for value in values:
                if value == current or not self._fits_budget():
                    continue
                trial = self.evaluate(incumbent.candidate.with_value(dim, value), dim)
                if self._better(trial, best):
                    best = trial
            return best
        index = values.index(current)
        best = incumbent
        for step in (1, -1):
            position = index + step
            moved = False
            while 0 <= position < len(values) and self._fits_budget():
                trial = self.evaluate(best.candidate.with_value(dim, values[position]), dim)
                if not self._better(trial, best):
                    break
                best, moved = trial, True
                position += step
            if moved:
                break  # improving upward: no need to look downward
        return best

    def screen_precisions(self) -> None:
        """Measure each precision of the space against fp32 and drop those past the
        accuracy budget (fp32 stays: it is the reference)."""
        budget = self.accuracy_budget
        if budget is None:
            return
        wanted = list(dict.fromkeys([*self.space.precision, self.config.precision]))
        lower = [p for p in wanted if p != "fp32"]
        try:
            reports = self._probe(lower) if lower else []
        except Exception:  # one at a time: a precision that does not load excludes itself
            reports = []
            for precision in lower:
                try:
                    reports += self._probe([precision])
                except Exception as err:  # e.g. bf16 refused on a CPU without bf16 products
                    reason = f"accuracy not measured: {type(err).__name__}: {err}"[:300]
                    self.excluded[precision] = reason
                    self.log(f"accuracy {precision}: {reason} -> excluded")
        for report in reports:
            self.accuracy[report.precision] = report
            problem = budget.problem(report)
            if problem is not None:
                self.excluded[report.precision] = f"outside the accuracy budget: {problem}"
            self.log(f"accuracy {report.line()}" + (f" -> excluded ({problem})" if problem else ""))
        self.space.precision = [p for p in wanted if p not in self.excluded] or ["fp32"]
        if "fp32" not in self.space.precision:
            self.space.precision.insert(0, "fp32")

    def run(self) -> TuneResult:
        self._start = time.monotonic()
        self.screen_precisions()
        start = Candidate.from_config(self.config)
        if start.precision in self.excluded:
            start = start.with_value("precision", "fp32")
        baseline = self.evaluate(start, "baseline")
        incumbent = baseline
        for _ in range(self.settings.max_passes):
            before = incumbent
            for dim in DIMENSIONS:
                if not self._fits_budget():
                    break
                incumbent = self._climb(incumbent, dim)
            if incumbent is before or self.stopped_by_budget:
                break
        winner = self._confirm(baseline)
        config = winner.candidate.apply(self.raw) if winner.best is not None else dict(self.raw)
        return TuneResult(
            model=self.model,
            settings=self.settings,
            baseline=baseline,
            winner=winner,
            evaluations=self.evaluations,
            elapsed_s=self.elapsed(),
            stopped_by_budget=self.stopped_by_budget,
            config=config,
            finalists=self.finalists,
            accuracy_budget=self.accuracy_budget,
            accuracy=dict(self.accuracy),
            excluded=dict(self.excluded),
        )

    def _confirm(self, baseline: Evaluation) -> Evaluation:
        ranked = sorted(
            (e for e in self.evaluations if e.best is not None), key=lambda e: e.score, reverse=True
        )
        if not ranked:
            return baseline
        finalists = ranked[: max(1, self.settings.confirm)]
        if baseline.best is not None and baseline not in finalists and self.settings.confirm:
            finalists.append(baseline)  # the current config is always re-measured with them
        if self.settings.confirm > 0 and len(finalists) > 1:
            for evaluation in finalists:
                if not self._fits_budget():
                    break
                levels, status, _ = self.measure(evaluation.candidate)
                again = Evaluation(evaluation.candidate, "confirm", levels, status=status)
                self._score(again)
                evaluation.runs.append(again.score)
                evaluation.score = sum(evaluation.runs) / len(evaluation.runs)
                self.log(
                    f"[{self.elapsed():6.0f}s] {'confirm':>18}: "
                    f"{evaluation.candidate.label():<60} runs "
                    + ", ".join(f"{r:.1f}" for r in evaluation.runs)
                )
        self.finalists = finalists
        winner = max(finalists, key=lambda e: e.score)
        if baseline.best is not None and winner is not baseline and winner.score < baseline.score:
            winner = baseline
        return winner
