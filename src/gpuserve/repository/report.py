"""What the repository index and the lifecycle endpoints report about models (read-only).

Rows carry Triton's index fields ``name``, ``version``, ``state`` (``READY``, ``LOADING``,
``UNLOADING``, ``UNAVAILABLE``) and ``reason``, plus ``traffic``: the share of the requests
that name no version which that version receives now (0..1).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gpuserve.repository.state import Model, VersionState


def model_status(model: Model) -> str:
    """One line: why ``model`` serves or does not (used in 503 messages)."""
    if model.error and not model.versions:
        return model.error
    states = []
    for v, mv in sorted(model.versions.items()):
        states.append(f"version {v} {mv.state.value}" + (f": {mv.reason}" if mv.reason else ""))
    for v, note in sorted(model.notes.items()):
        if v not in model.versions:
            states.append(f"version {v} {note}")
    return "; ".join(states) or "not loaded"


def version_rows(model: Model) -> list[dict[str, Any]]:
    """One index row per version the model has loaded, is loading, or has a note about."""
    rows = []
    for v in sorted(set(model.versions) | set(model.pending) | set(model.notes)):
        mv = model.versions.get(v)
        if mv is not None:
            state, reason = mv.state.value, mv.reason
            if v in model.pending:
                reason = reason or "a new load of this version is in progress"
            elif v in model.notes and mv.state is VersionState.READY:
                reason = f"still serving the previous load: {model.notes[v]}"
        elif v in model.pending:
            state, reason = "LOADING", ""
        else:
            state, reason = "UNAVAILABLE", model.notes[v]
        if mv is not None and mv is model.route.default and model.warning:
            reason = f"{reason}; {model.warning}" if reason else model.warning
        traffic = model.route.share(mv) if mv is not None else 0.0
        rows.append(
            {
                "name": model.name,
                "version": str(v),
                "state": state,
                "reason": reason,
                "traffic": round(traffic, 6),
            }
        )
    return rows


def index_rows(models: dict[str, Model], ready_only: bool = False) -> list[dict[str, Any]]:
    """The V2 repository index: rows of every model by name; a model without any version row
    gets one row with an empty version and why it has none."""
    rows: list[dict[str, Any]] = []
    for name, model in sorted(models.items()):
        model_rows = version_rows(model) or [
            {
                "name": name,
                "version": "",
                "state": "UNAVAILABLE",
                "reason": model.error or "not loaded",
                "traffic": 0.0,
            }
        ]
        rows.extend(r for r in model_rows if not ready_only or r["state"] == "READY")
    return rows


def model_summary(model: Model) -> dict[str, Any]:
    """The lifecycle endpoints' answer: served version, canary, held back versions, rows."""
    route = model.route
    canary = None
    if route.canary is not None:
        canary = {"version": str(route.canary.version), "weight": route.weight}
    return {
        "name": model.name,
        "served_version": str(route.default.version) if route.default else None,
        "canary": canary,
        "held_back": [str(v) for v in sorted(model.held)],
        "versions": version_rows(model),
    }


def load_failed(name: str, failures: Mapping[int, str], served: int | None) -> str:
    """The error of a load request of model ``name`` in which versions failed.

    Args:
        name: The model.
        failures: The reason of each version that failed, by number.
        served: The version that keeps serving, or None.
    """
    causes = "; ".join(f"version {v}: {why}" for v, why in sorted(failures.items()))
    tail = f"; version {served} keeps serving" if served is not None else ""
    return f"failed to load model '{name}': {causes}{tail}"


def load_summary(models: Iterable[Model], wanted: set[str]) -> tuple[str, int]:
    """The start-up summary line and how many failures it counts: the versions READY, the
    versions that failed to load, and the models among ``wanted`` (those the initial load was
    asked for) that could not be loaded at all (an invalid config, no version folder), e.g.
    ``2 version(s) ready: a:1, b:1; 1 version(s) failed to load: c:1``."""
    ready: list[str] = []
    failed: list[str] = []
    unloadable: list[str] = []
    for model in models:
        serving = model.ready_versions()
        ready += [f"{model.name}:{v}" for v in serving]
        failed += [f"{model.name}:{v}" for v in sorted(set(model.failed) - set(serving))]
        if model.error and model.name in wanted and not model.versions:
            unloadable.append(model.name)
    parts = [f"{len(ready)} version(s) ready: {', '.join(ready) or 'none'}"]
    if failed:
        parts.append(f"{len(failed)} version(s) failed to load: {', '.join(failed)}")
    if unloadable:
        parts.append(f"{len(unloadable)} model(s) cannot be loaded: {', '.join(unloadable)}")
    return "; ".join(parts), len(failed) + len(unloadable)
