"""The request path: which model version takes a request, and whether the server is ready.

Every inference request passes through :meth:`Router.version` (and :meth:`Router.split` when
it names no version), so these only read: a dict lookup or two on the state the manager keeps,
never a lock or an await. Their error messages are the ones clients see in 404 and 503
answers. :class:`~gpuserve.repository.manager.ModelManager` extends :class:`Router`, so a
request pays no extra call to reach them.

Server readiness rule (documented in the README): the server is ready when the initial load
has finished, it is not shutting down, and at least one model version is READY. With
``strict_readiness`` every *required* model must have a READY version instead: the models
loaded at start and those loaded since, until they are unloaded or removed. A failed load
never turns a serving server unready, and an empty server is never ready (BC-16, BC-17),
except with ``load_on_demand``, where models load at their first request: the server is
then ready with nothing loaded (and, with ``strict_readiness``, ready while no model is
required, i.e. none is pinned or loaded).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

from gpuserve.engine.runners.base import VersionRunner
from gpuserve.errors import ModelNotFoundError, ModelNotReadyError
from gpuserve.repository.lifecycle.loading import serving
from gpuserve.repository.report import model_status
from gpuserve.repository.state import Model, ModelVersion, VersionState

__all__ = ["Router"]


class Router:
    """The request path over a manager's models (it only reads them).

    Args:
        models: The models by name (the manager's; changed only by the manager).
        strict_readiness: The readiness rule (module docstring).

    Attributes:
        models: As given.
        strict_readiness: As given.
        initial_load_done: The initial load has finished.
        shutting_down: The server is shutting down (not ready; set by the manager and the
            server runner).
        ready_when_empty: Models load on demand: ready with nothing loaded (non-strict rule).
    """

    def __init__(
        self, models: dict[str, Model] | None = None, *, strict_readiness: bool = False
    ) -> None:
        self.models: dict[str, Model] = {} if models is None else models
        self.strict_readiness = strict_readiness
        self.initial_load_done = False
        self.shutting_down = False
        self.ready_when_empty = False

    def model(self, name: str) -> Model:
        """The model called ``name``.

        Raises:
            ModelNotFoundError: no such model in the repository.
        """
        model = self.models.get(name)
        if model is None:
            known = ", ".join(sorted(self.models)) or "none"
            # Triton's wording, which Triton's clients and tools look for.
            raise ModelNotFoundError(
                f"Request for unknown model: '{name}' is not found "
                f"(models in the repository: {known})"
            )
        return model

    def version(self, name: str, version: str | None) -> ModelVersion:
        """The version to serve: the named one, or the default one of the route.

        Args:
            name: The model name of the request.
            version: The version the request names (decimal digits), or None / "" for the
                default version.

        Raises:
            ModelNotFoundError: unknown model or version.
            ModelNotReadyError: the model or version exists but is not READY (loading,
                failed, unloading, unloaded, or every instance being replaced), with the
                reason.
        """
        model = self.models.get(name)
        if model is None:
            model = self.model(name)
        if version:
            mv = model.versions.get(int(version)) if version.isdigit() else None
            if mv is None:
                _missing_version(model, version)
            if mv.state is not VersionState.READY:
                raise ModelNotReadyError(
                    f"model '{name}' version {version} is not ready: {mv.state.value}"
                    + (f" ({mv.reason})" if mv.reason else "")
                )
            return serving(mv)
        mv = model.route.default
        if mv is None or mv.state is not VersionState.READY:
            raise ModelNotReadyError(f"model '{name}' is not ready: {model_status(model)}")
        return serving(mv)

    def split(self, mv: ModelVersion, request_id: str | None) -> ModelVersion:
        """Where an unversioned request that :meth:`version` resolved to ``mv`` goes: ``mv``,
        or the model's canary for the canary's share (by a hash of ``request_id``; at random
        without one). A canary that stopped being READY takes nothing."""
        model = self.models.get(mv.model)
        route = model.route if model is not None else None
        if route is None or route.canary is None or route.default is not mv:
            return mv
        chosen = route.pick(request_id)
        return chosen if chosen is not None and chosen.state is VersionState.READY else mv

    def canary_split(self, mv: ModelVersion, request_id: Callable[[], str | None]) -> ModelVersion:
        """:meth:`split`, reading the request id (``request_id()``, which may raise) only when
        ``mv``'s model has a canary in its route: the request path of a model without one
        pays for no id."""
        model = self.models.get(mv.model)
        route = model.route if model is not None else None
        if route is None or route.canary is None or route.default is not mv:
            return mv
        chosen = route.pick(request_id())
        return chosen if chosen is not None and chosen.state is VersionState.READY else mv

    def runner(self, name: str, version: str | None) -> VersionRunner:
        """The runner of the version serving ``name`` (see :meth:`version`)."""
        runner = self.version(name, version).runner
        assert runner is not None
        return runner

    def is_ready(self) -> bool:
        """Server readiness (rule in the module docstring)."""
        if self.shutting_down or not self.initial_load_done:
            return False
        models = list(self.models.values())
        if not self.strict_readiness:
            if self.ready_when_empty:
                return True
            return any(m.route.default is not None for m in models)
        required = [m for m in models if m.required]
        if not required:  # on demand with nothing pinned: models load at their first request
            return self.ready_when_empty
        return all(m.route.default is not None for m in required)

    def in_flight(self) -> int:
        """Requests queued or running in every loaded version."""
        return sum(
            mv.runner.in_flight_requests
            for model in list(self.models.values())
            for mv in list(model.versions.values())
            if mv.runner is not None
        )


def _missing_version(model: Model, version: str) -> NoReturn:
    number = int(version) if version.isdigit() else None
    if number is not None and number in model.pending:
        raise ModelNotReadyError(f"model '{model.name}' version {version} is not ready: LOADING")
    if number is not None and number in model.notes:
        raise ModelNotReadyError(
            f"model '{model.name}' version {version} is not ready: {model.notes[number]}"
        )
    raise ModelNotFoundError(
        f"model '{model.name}' has no version '{version}' "
        f"(versions served: {model.ready_versions()})"
    )
