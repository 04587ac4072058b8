"""Which models stay loaded: the limits, least-recently-used eviction and idle unload.

A pure policy over :class:`Resident` snapshots (no I/O, no awaits, no clock of its own: every
time is an argument, seconds on one clock), carried out by
:mod:`gpuserve.repository.ondemand.loader`:

* :func:`make_room`: before a model loads, the least recently used models to unload so that
  the loaded count and the memory per device stay within :class:`Limits` once it has loaded,
  or why no room can be made now (every candidate is pinned or busy);
* :func:`over_budget`: after a load measured more memory than expected, what else goes;
* :func:`idle_due` / :func:`next_idle_check`: models with no request for their
  ``idle_unload_s``, and when to look again.

A model that is *busy* (queued or running requests, requests waiting for it to load, a change
in progress) or *pinned* is never chosen.

The budget policy for a model larger than the whole memory limit on a device: it is **served
alone** there. Its need is counted as the whole budget, so every other model holding memory on
that device is evicted first, and :attr:`Room.alone` carries the warning to log. When no room
can be made, :attr:`Room.permanent` tells whether waiting could help: it cannot when pinned
models alone leave no room (busy models finish and become evictable; pinned ones never do), so
the request is refused at once instead of waiting out its load timeout.
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
        permanent: With ``blocked``: no room will ever be made while the pinned models stay
            (refuse at once); False: busy models may become evictable (wait).
        alone: The model alone needs more than the memory limit on a device: it is served
            alone there, above the limit (the warning to log), or "".
    """

    evict: tuple[str, ...] = ()
    reason: str = LRU
    blocked: str | None = None
    permanent: bool = False
    alone: str = ""


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


def _clamped(need: Mapping[str, int], budget: int) -> dict[str, int]:
    """``need`` with each device's share cut to the whole budget: a model larger than the
    budget fits once nothing else holds memory there (served alone)."""
    if budget <= 0:
        return dict(need)
    return {d: min(n, budget) for d, n in need.items()}


def _alone(name: str, need: Mapping[str, int], budget: int) -> str:
    over = sorted(d for d, n in need.items() if budget > 0 and n > budget)
    if not over:
        return ""
    sizes = ", ".join(f"{d} {need[d]} B" for d in over)
    return (
        f"model '{name}' needs {sizes}, more than the whole loaded models memory limit of "
        f"{budget} B per device: it is served alone there, above the limit"
    )


def _permanent(
    others: Sequence[Resident], need: Mapping[str, int], limits: Limits, extra: int
) -> bool:
    """Whether the pinned ``others`` alone leave no room (no wait can help)."""
    pinned = [r for r in others if r.pinned]
    if limits.max_models > 0 and len(pinned) + extra > limits.max_models:
        return True
    return _over(_totals(pinned), need, limits.memory_bytes)


def _plan(
    others: Sequence[Resident], wanted: Mapping[str, int], limits: Limits, extra: int, what: str
) -> Room:
    """Evict least recently used ``others`` until ``extra`` more models and ``wanted`` more
    bytes (each device's share cut to the budget) fit within ``limits``."""
    need = _clamped(wanted, limits.memory_bytes)
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
            permanent=_permanent(others, need, limits, extra),
        )
    if _over(totals, need, limits.memory_bytes):
        wanted_text = ", ".join(f"{d} {n} B" for d, n in sorted(wanted.items()) if n)
        wanted_text = wanted_text or "its memory"
        return Room(
            reason=MEMORY,
            blocked=_blocked(
                what,
                f"the loaded models memory limit of {limits.memory_bytes} B per device "
                f"leaves no room for {wanted_text}",
                others,
            ),
            permanent=_permanent(others, need, limits, extra),
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
    room = _plan(others, need, limits, 1, f"model '{incoming}' cannot be loaded")
    alone = _alone(incoming, need, limits.memory_bytes)
    return Room(room.evict, room.reason, room.blocked, room.permanent, alone) if alone else room


def over_budget(residents: Sequence[Resident], loaded: str, limits: Limits) -> Room:
    """After ``loaded`` loaded and was measured: what else to unload so the loaded models fit
    ``limits`` (``loaded`` itself stays)."""
    others = [r for r in residents if r.name != loaded]
    own = next((r.memory_bytes for r in residents if r.name == loaded), {})
    room = _plan(others, own, limits, 1, f"model '{loaded}' loaded past the limits")
    alone = _alone(loaded, own, limits.memory_bytes)
    if room.blocked is None:
        return Room(room.evict, MEMORY if room.evict else room.reason, alone=alone)
    return Room(room.evict, room.reason, room.blocked, room.permanent, alone)


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


def expected_memory(
    name: str,
    measured: Mapping[str, Mapping[str, int]],
    estimate: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """What ``name`` is expected to hold once loaded, by device, bytes: its own last
    measurement, else ``estimate`` (its configured ``expected_memory_bytes``, or what its own
    files tell: see :func:`gpuserve.repository.ondemand.estimate.expected`), else nothing. Never
    another model's measurement: one large model must not make every model never loaded look
    as large (and find no room)."""
    own = measured.get(name)
    if own is not None:
        return dict(own)
    return dict(estimate) if estimate else {}
