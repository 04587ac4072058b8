"""The state the model manager keeps per model: its versions, and how traffic is routed.

Two things are kept apart:

* the **loaded set** (:attr:`Model.versions`): each version with its state and runner;
* the **route** (:attr:`Model.route`): which loaded version takes requests that name no
  version (the *default*), and optionally a *canary* with its share of them.

The route is an immutable :class:`Route` replaced in one assignment on the event loop, so a
request sees either the old route or the new one, never a mix. A version joins the route only
after it is READY (loaded and warmed up), and leaves it before it starts draining.

States of a version: LOADING -> READY, or LOADING -> UNAVAILABLE (failed, with the reason);
READY -> UNLOADING (draining) -> gone (reported as UNAVAILABLE "unloaded").
"""

from __future__ import annotations

import enum
import hashlib
import random
from dataclasses import dataclass, field
from pathlib import Path

from gpuserve.config import CanaryConfig, ModelConfig
from gpuserve.engine.runners.base import VersionRunner
from gpuserve.repository.scan import Fingerprint, ModelEntry


class VersionState(enum.StrEnum):
    """State of one model version, as the repository index shows it (Triton's names)."""

    LOADING = "LOADING"
    READY = "READY"
    FAILED = "UNAVAILABLE"
    UNLOADING = "UNLOADING"


@dataclass(slots=True, eq=False)
class ModelVersion:
    """One version of a model and its runner (None until loaded, and after unloading).

    Attributes:
        model / version: Which model version.
        path: Its version folder.
        config: The config it is served with (completed by the backend at load).
        state: See :class:`VersionState`.
        reason: Why it is not READY (load error), or "".
        runner: Its runner while loaded (batching, streaming or ensemble).
        fingerprint: The version folder's content when it was loaded.
        source_config: The model configuration it was loaded from (before the backend
            completed it): a different one means the version must load again.
    """

    model: str
    version: int
    path: Path
    config: ModelConfig
    state: VersionState = VersionState.LOADING
    reason: str = ""
    runner: VersionRunner | None = None
    fingerprint: Fingerprint = ()
    source_config: ModelConfig | None = None


@dataclass(slots=True, frozen=True)
class Route:
    """Where requests that name no version go. Immutable: replaced, never changed.

    Attributes:
        default: The served version (None: nothing to serve).
        canary: A second version taking ``weight`` of the requests, or None.
        weight: The canary's share, 0..1.
    """

    default: ModelVersion | None = None
    canary: ModelVersion | None = None
    weight: float = 0.0

    def pick(self, request_id: str | None) -> ModelVersion | None:
        """The version for one request: the canary for a ``weight`` share, else the default.

        A request with an id always takes the same side (a hash of the id), so a client that
        retries with the same id sees the same version; one without an id goes at random.
        """
        if self.canary is None:
            return self.default
        return self.canary if split_point(request_id) < self.weight else self.default

    def share(self, mv: ModelVersion) -> float:
        """The share of unversioned requests ``mv`` receives (0..1)."""
        if mv is self.canary:
            return self.weight
        if mv is self.default:
            return 1.0 - self.weight if self.canary is not None else 1.0
        return 0.0


def split_point(request_id: str | None) -> float:
    """A number in [0, 1): a hash of ``request_id``, or random when there is none."""
    if not request_id:
        return random.random()
    digest = hashlib.blake2b(request_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


@dataclass(slots=True)
class Model:
    """A model of the repository: its versions, its route and its lifecycle settings.

    Attributes:
        name: The model (folder) name.
        config: What metadata and ``/config`` show: the served version's config, else the
            configuration the model would load with.
        versions: Loaded versions by number (LOADING ones with a new number, READY ones,
            UNLOADING ones while they drain).
        error: Why the model cannot be served at all (bad config, no version folder), or None.
        path: The model folder.
        source_config: The configuration new versions load with (``config.yaml``, or the
            override of the last load request).
        override: Whether ``source_config`` came from a load request.
        pending: Versions loading to replace a loaded version of the same number.
        notes: Per version that is not loaded: why (failed to load, incomplete, unloaded).
        failed: Per version that failed to load: its folder's fingerprint then (``poll``
            retries only once the folder changes).
        warning: A problem while the model keeps serving (an invalid ``config.yaml`` edit).
        route: Where unversioned requests go (see :class:`Route`).
        held: Versions held back (rolled back from, or an aborted canary), with their folder's
            fingerprint then: the version policy skips them until they are loaded explicitly,
            promoted, or their folder changes.
        canary: The canary in effect (from the config or the API), or None.
        history: Versions served before, most recent last (rollback pops it).
        required: Counts for strict readiness (loaded at start, or loaded since).
        entry: The repository scan the loaded set was last brought in line with (rollback
            and canary work from it, so they never pick up unrelated repository changes).
        pinned: Loaded explicitly at start: never evicted nor unloaded when idle (a config
            with ``pinned: true`` pins it too).
        loaded_at_s: When it last loaded (wall-clock seconds; counts as a use for LRU).
        memory_bytes: Memory it gained while loading, by device (``cpu``, ``cuda:<n>``),
            bytes; empty when not loaded or not measured.
        evicted: Why it was last unloaded to make room or when idle (``lru``, ``memory``,
            ``idle``), or None: its next request loads it again.
    """

    name: str
    config: ModelConfig | None
    versions: dict[int, ModelVersion] = field(default_factory=dict)
    error: str | None = None
    path: Path | None = None
    source_config: ModelConfig | None = None
    override: bool = False
    pending: dict[int, ModelVersion] = field(default_factory=dict)
    notes: dict[int, str] = field(default_factory=dict)
    failed: dict[int, Fingerprint] = field(default_factory=dict)
    warning: str | None = None
    route: Route = field(default_factory=Route)
    held: dict[int, Fingerprint] = field(default_factory=dict)
    canary: CanaryConfig | None = None
    history: list[int] = field(default_factory=list)
    required: bool = False
    entry: ModelEntry | None = None
    pinned: bool = False
    loaded_at_s: float = 0.0
    memory_bytes: dict[str, int] = field(default_factory=dict)
    evicted: str | None = None

    def ready_versions(self) -> list[int]:
        """READY version numbers, ascending."""
        return sorted(v for v, mv in self.versions.items() if mv.state is VersionState.READY)

    def served_version(self) -> int | None:
        """The default version's number, or None."""
        return self.route.default.version if self.route.default is not None else None
