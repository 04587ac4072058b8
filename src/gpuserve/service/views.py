"""Read views of the server's state, as typed dataclasses each front end encodes.

The HTTP front end serialises them to JSON (``orjson`` writes a dataclass's fields in their
declared order, which is the order of the V2/Triton bodies), the gRPC front end builds protobuf
messages from them. Both answer from the same view, so they cannot disagree.

Lookups raise the errors of :mod:`gpuserve.errors`: ``ModelNotFoundError`` for an unknown
model or version, ``ModelNotReadyError`` for a model whose configuration cannot be read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gpuserve
from gpuserve.config import ModelConfig
from gpuserve.engine.stats import ModelStats
from gpuserve.errors import GpuserveError, ModelNotFoundError, ModelNotReadyError
from gpuserve.repository.manager import Model, ModelManager, ModelVersion
from gpuserve.service.constants import EXTENSIONS, SERVER_NAME, platform
from gpuserve.service.names import check_version_label


@dataclass(frozen=True, slots=True)
class ServerMetadata:
    """``GET /v2`` / ``ServerMetadata``: name, release and supported extensions."""

    name: str
    version: str
    extensions: list[str]


@dataclass(frozen=True, slots=True)
class TensorMetadata:
    """One input or output: V2 datatype name and shape (``-1`` = variable; the batch
    dimension first, as ``-1``, when the model batches)."""

    name: str
    datatype: str
    shape: list[int]


@dataclass(frozen=True, slots=True)
class IndexRow:
    """One row of the repository index (Triton's fields, plus gpuserve's ``traffic``).

    Attributes:
        name / version: The model and version (version ``""`` for a model with none).
        state: ``READY``, ``LOADING``, ``UNLOADING`` or ``UNAVAILABLE``.
        reason: Why it is not READY (or what else is true of it), or ``""``.
        traffic: Share of the requests naming no version that this version takes, 0..1.
    """

    name: str
    version: str
    state: str
    reason: str
    traffic: float


@dataclass(frozen=True, slots=True)
class ModelMetadata:
    """``GET /v2/models/{m}`` / ``ModelMetadata``.

    Attributes:
        version_states: gpuserve's addition over HTTP: each version's state, reason and
            traffic share.
    """

    name: str
    versions: list[str]
    version_states: list[IndexRow]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


@dataclass(frozen=True, slots=True)
class ModelConfigView:
    """The configuration a model is served with (its served version's, completed by the
    backend at load), with the platform name Triton clients expect."""

    name: str
    platform: str
    config: ModelConfig


@dataclass(frozen=True, slots=True)
class ReadyView:
    """Whether a model (version) takes requests now, and why not."""

    ready: bool
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class CanaryView:
    """The canary of a model: its version and its share (0..1) of unversioned requests."""

    version: str
    weight: float


@dataclass(frozen=True, slots=True)
class ModelStatusView:
    """A model's routing: served version, canary, held back versions and its index rows
    (the answer of the repository's lifecycle calls)."""

    name: str
    served_version: str | None
    canary: CanaryView | None
    held_back: list[str]
    versions: list[IndexRow]


@dataclass(frozen=True, slots=True)
class TraceView:
    """A started profiler trace: the model version traced, the batch count, and the trace
    folder relative to the server's trace directory (answers carry no host paths)."""

    model: str
    version: str
    batches: int
    trace: str


def index_row(row: dict[str, Any]) -> IndexRow:
    """An index row from the manager's report dict."""
    return IndexRow(row["name"], row["version"], row["state"], row["reason"], row["traffic"])


def status_view(summary: dict[str, Any]) -> ModelStatusView:
    """A :class:`ModelStatusView` from the manager's ``status`` dict."""
    canary = summary["canary"]
    return ModelStatusView(
        name=summary["name"],
        served_version=summary["served_version"],
        canary=CanaryView(canary["version"], canary["weight"]) if canary else None,
        held_back=list(summary["held_back"]),
        versions=[index_row(row) for row in summary["versions"]],
    )


class Views:
    """Builds the read views from the model manager's state (nothing here changes it).

    Args:
        manager: The model manager.
    """

    def __init__(self, manager: ModelManager) -> None:
        self.manager = manager

    def server_metadata(self) -> ServerMetadata:
        """The server's name, release and extensions."""
        return ServerMetadata(SERVER_NAME, gpuserve.__version__, list(EXTENSIONS))

    def lookup(self, name: str, version: str | None) -> tuple[Model, list[ModelVersion]]:
        """Model ``name`` and its loaded versions (all, or only ``version``).

        Raises:
            ModelNotFoundError: no such model, or it has no loaded version ``version``.
        """
        check_version_label(name, version)
        model = self.manager.model(name)
        if version is None:
            return model, list(model.versions.values())
        if not version.isdigit() or int(version) not in model.versions:
            raise ModelNotFoundError(
                f"model '{name}' has no version '{version}' (versions: {sorted(model.versions)})"
            )
        return model, [model.versions[int(version)]]

    def _config_of(self, model: Model) -> ModelConfig:
        if model.config is None:
            raise ModelNotReadyError(f"model '{model.name}' is not ready: {model.error}")
        return model.config

    def model_metadata(self, name: str, version: str | None) -> ModelMetadata:
        """Metadata of model ``name`` (``version``: only that loaded version).

        Raises:
            ModelNotFoundError / ModelNotReadyError: see :meth:`lookup`; not ready when the
                model's configuration cannot be read.
        """
        model, versions = self.lookup(name, version)
        config = self._config_of(model)
        batch = [-1] if config.max_batch_size else []
        states = [
            index_row(row)
            for row in self.manager.status(name)["versions"]
            if version is None or row["version"] == version
        ]
        return ModelMetadata(
            name=name,
            versions=[str(mv.version) for mv in versions],
            version_states=states,
            platform=platform(config.backend),
            inputs=[
                TensorMetadata(t.name, t.datatype, batch + list(t.shape)) for t in config.inputs
            ],
            outputs=[
                TensorMetadata(t.name, t.datatype, batch + list(t.shape)) for t in config.outputs
            ],
        )

    def model_config(self, name: str, version: str | None) -> ModelConfigView:
        """The configuration model ``name`` is served with.

        Raises:
            ModelNotFoundError / ModelNotReadyError: as :meth:`model_metadata`.
        """
        model, _ = self.lookup(name, version)
        config = self._config_of(model)
        return ModelConfigView(name, platform(config.backend), config)

    def model_ready(self, name: str, version: str | None) -> ReadyView:
        """Whether model ``name`` (version ``version``, else its default version) is ready.

        A model that a request would load on demand (not loaded, or evicted) is ready
        unless that request would be refused: while the back-off of its last failed load
        lasts (its folder unchanged), or without a valid configuration. A probe never
        starts a load. So a client's ``is_model_ready()`` followed by an inference works
        under ``--load-on-demand``: the inference loads the model.

        Raises:
            ModelNotFoundError: no such model or version (any other reason is a not-ready
                view with the reason).
        """
        check_version_label(name, version)
        if self.manager.cold(name) and (not version or self._version_folder(name, version)):
            why = self.manager.on_demand.ready_reason(name)
            return ReadyView(why is None, why)
        try:
            self.manager.version(name, version)
        except ModelNotFoundError:
            raise
        except GpuserveError as err:
            return ReadyView(False, err.message)
        return ReadyView(True)

    def _version_folder(self, name: str, version: str) -> bool:
        """Whether model ``name`` has a version folder ``version`` (a cold model's readiness
        for a named version)."""
        model = self.manager.models.get(name)
        path = model.path if model is not None else None
        return version.isdigit() and path is not None and (path / version).is_dir()

    def server_ready(self) -> bool:
        """Server readiness (the rule of :meth:`ModelManager.is_ready`)."""
        return self.manager.is_ready()

    def statistics(self, name: str | None, version: str | None) -> list[ModelStats]:
        """Statistics of every loaded version (``name`` None), of one model, or of one version.

        Raises:
            ModelNotFoundError: as :meth:`lookup`.
        """
        if name is None:
            versions = [
                mv for m in list(self.manager.models.values()) for mv in m.versions.values()
            ]
        else:
            _, versions = self.lookup(name, version)
        return [mv.runner.stats for mv in versions if mv.runner is not None]

    def model_names(self) -> list[str]:
        """Every model the repository holds, by name, sorted: KServe's model list (a model
        that is not ready is listed too; its readiness is ``/v2/models/{m}/ready``)."""
        return sorted({row.name for row in self.index()})

    def index(self, ready_only: bool = False) -> list[IndexRow]:
        """The repository index: every model version and its state."""
        return [index_row(row) for row in self.manager.index(ready_only)]

    def model_status(self, name: str) -> ModelStatusView:
        """Model ``name``'s routing and versions.

        Raises:
            ModelNotFoundError: no such model.
        """
        return status_view(self.manager.status(name))
