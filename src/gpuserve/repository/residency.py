"""Which models stay loaded: the limits, least-recently-used eviction and idle unload.

A pure policy over :class:`Resident` snapshots (no I/O, no awaits, no clock of its own: every
time is an argument, seconds on one clock), carried out by
:mod:`gpuserve.repository.ondemand`:

* :func:`make_room`: before a model loads, the least recently used models to unload so that
  the loaded count and the memory per device stay within :class:`Limits` once it has loaded,
  or why no room can be made now (every candidate is pinned or busy);
* :func:`over_budget`: after a load measured more memory than expected, what else goes;
* :func:`idle_due` / :func:`next_idle_check`: models with no request for their
  ``idle_unload_s``, and when to look again.

A model that is *busy* (queued or running requests, requests waiting for it to load, a change
in progress) or *pinned* is never chosen.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

#: Eviction reasons (``gpuserve_model_evictions_total{reason}`` and the index).
LRU = "lru"
MEMORY = "memory"
IDLE = "idle"

#: The memory key of resident host memory (CPU models); GPU memory uses ``cuda:<n>``.
HOST = "cpu"


@dataclass(frozen=True, slots=True)
class Limits:
    """What may be loaded at once.

    Attributes:
        max_models: Most models loaded at once (0: no limit).
        memory_bytes: Most memory the loaded models may hold per device, bytes (0: no limit).
    """

    max_models: int = 0
    memory_bytes: int = 0

    @property
    def limited(self) -> bool:
        """Whether any limit is set."""
        return self.max_models > 0 or self.memory_bytes > 0


@dataclass(frozen=True, slots=True)
class Resident:
    """One loaded (or loading) model, as the policy sees it.

    Attributes:
        name: The model name.
        last_used_s: Its last request, or when it loaded if later (seconds).
        busy: Requests are queued, running or waiting for it, or a change is in progress.
        pinned: Never evicted nor unloaded when idle.
        memory_bytes: Memory it holds by device (``cpu`` or ``cuda:<n>``), bytes.
        idle_unload_s: Unload after this many seconds without a request (0: never).
    """

    name: str
    last_used_s: float
    busy: bool = False
    pinned: bool = False
    memory_bytes: Mapping[str, int] = field(default_factory=dict)
    idle_unload_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Room:
    """The answer of :func:`make_room` / :func:`over_budget`.

    Attributes:
        evict: Models to unload, least recently used first (empty when ``blocked``).
        reason: Why they go (:data:`LRU` for the count limit, :data:`MEMORY`).
        blocked: Why no room can be made now, or None.
    """

    evict: tuple[str, ...] = ()
    reason: str = LRU
    blocked: str | None = None


def _totals(residents: Iterable[Resident]) -> dict[str, int]:
    totals: dict[str, int] = {}
    for r in residents:
        for device, size in r.memory_bytes.items():
            totals[device] = totals.get(device, 0) + size
    return totals


def _over(totals: Mapping[str, int], need: Mapping[str, int], budget: int) -> bool:
    if budget <= 0:
        return False
    devices = set(totals) | set(need)
    return any(totals.get(d, 0) + need.get(d, 0) > budget for d in devices)


def _over_devices(totals: Mapping[str, int], need: Mapping[str, int], budget: int) -> set[str]:
    if budget <= 0:
        return set()
    return {d for d in set(totals) | set(need) if totals.get(d, 0) + need.get(d, 0) > budget}


def _plan(
    others: Sequence[Resident], need: Mapping[str, int], limits: Limits, extra: int, what: str
) -> Room:
    """Evict least recently used ``others`` until ``extra`` more models and ``need`` more
    bytes fit within ``limits``."""
    kept = list(others)
    totals = _totals(kept)
    count_full = limits.max_models > 0 and len(kept) + extra > limits.max_models
    memory_full = _over(totals, need, limits.memory_bytes)
    if not count_full and not memory_full:
        return Room()
    reason = LRU if count_full else MEMORY
    candidates = sorted((r for r in kept if not r.busy and not r.pinned), key=_lru_key)
    evict: list[str] = []
    for victim in candidates:
        count_over = limits.max_models > 0 and len(kept) + extra > limits.max_models
        over = _over_devices(totals, need, limits.memory_bytes)
        if not count_over and not over:
            break
        if not count_over and not any(victim.memory_bytes.get(d, 0) for d in over):
            continue  # holds nothing on the devices that are full
        kept.remove(victim)
        evict.append(victim.name)
        for device, size in victim.memory_bytes.items():
            totals[device] -= size
    if limits.max_models > 0 and len(kept) + extra > limits.max_models:
        return Room(
            reason=LRU,
            blocked=_blocked(
                what, f"the limit of {limits.max_models} loaded models is reached", others
            ),
        )
    if _over(totals, need, limits.memory_bytes):
        wanted = ", ".join(f"{d} {n} B" for d, n in sorted(need.items()) if n) or "its memory"
        return Room(
            reason=MEMORY,
            blocked=_blocked(
                what,
                f"the loaded models memory limit of {limits.memory_bytes} B per device "
                f"leaves no room for {wanted}",
                others,
            ),
        )
    return Room(tuple(evict), reason)


def _lru_key(r: Resident) -> tuple[float, str]:
    return (r.last_used_s, r.name)


def _blocked(what: str, limit: str, residents: Sequence[Resident]) -> str:
    pinned = sorted(r.name for r in residents if r.pinned)
    busy = sorted(r.name for r in residents if r.busy and not r.pinned)
    parts = []
    if pinned:
        parts.append(f"pinned: {', '.join(pinned)}")
    if busy:
        parts.append(f"busy: {', '.join(busy)}")
    held = "; ".join(parts) or "none loaded"
    return f"{what}: {limit} and no loaded model can be unloaded now ({held})"


def make_room(
    residents: Sequence[Resident], incoming: str, need: Mapping[str, int], limits: Limits
) -> Room:
    """The models to unload before ``incoming`` loads.

    Args:
        residents: Every loaded or loading model (``incoming`` among them is ignored).
        incoming: The model about to load.
        need: Its expected memory by device, bytes (its last measurement, or a guess).
        limits: The limits.

    Returns:
        The least recently used evictable models whose unloading makes room, or ``blocked``
        with the reason when the others are pinned or busy.
    """
    others = [r for r in residents if r.name != incoming]
    return _plan(others, need, limits, 1, f"model '{incoming}' cannot be loaded")


def over_budget(residents: Sequence[Resident], loaded: str, limits: Limits) -> Room:
    """After ``loaded`` loaded and was measured: what else to unload so the loaded models fit
    ``limits`` (``loaded`` itself stays)."""
    others = [r for r in residents if r.name != loaded]
    own = next((r.memory_bytes for r in residents if r.name == loaded), {})
    room = _plan(others, own, limits, 1, f"model '{loaded}' loaded past the limits")
    if room.blocked is None:
        return Room(room.evict, MEMORY if room.evict else room.reason)
    return room


def idle_due(residents: Iterable[Resident], now_s: float) -> tuple[str, ...]:
    """Models idle for their ``idle_unload_s`` at ``now_s`` (never pinned or busy ones)."""
    return tuple(
        r.name
        for r in residents
        if r.idle_unload_s > 0
        and not r.pinned
        and not r.busy
        and now_s - r.last_used_s >= r.idle_unload_s
    )


def next_idle_check(residents: Iterable[Resident], now_s: float) -> float | None:
    """Seconds until the next model may turn idle (0 when one is due now), or None when no
    model unloads when idle. A busy model is checked again after its ``idle_unload_s``."""
    waits = []
    for r in residents:
        if r.idle_unload_s <= 0 or r.pinned:
            continue
        if r.busy:
            waits.append(r.idle_unload_s)
        else:
            waits.append(max(0.0, r.last_used_s + r.idle_unload_s - now_s))
    return min(waits) if waits else None


def expected_memory(name: str, measured: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
    """What ``name`` is expected to hold once loaded: its last measurement, else the largest
    measured model's (a guess that errs on the side of making room), else nothing."""
    own = measured.get(name)
    if own is not None:
        return dict(own)
    largest: dict[str, int] = {}
    for sizes in measured.values():
        if sum(sizes.values()) > sum(largest.values()):
            largest = dict(sizes)
    return largest
