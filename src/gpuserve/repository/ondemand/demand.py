"""The pure core of load on demand: what a request for a model that is not loaded gets.

:func:`decide` is called by :class:`~gpuserve.repository.ondemand.loader.OnDemand` (the asyncio
driver) each time a load on demand may start, and by the randomised tests on a fake clock.
It reads only its arguments (no I/O, no clock of its own; times are seconds on the clock of
:class:`~gpuserve.repository.lifecycle.retry.RetryBackoff`):

1. **Back-off.** When every version the load would load failed with the folder content and
   the configuration it has now and the back-off has not passed, the request is refused at
   once (503) naming the last error and when the next attempt is due. Nothing is evicted for
   it. A change to its files or its configuration, or an explicit load, ends the back-off.
2. **Room.** Otherwise :func:`~gpuserve.repository.ondemand.residency.make_room` picks what to evict.
   A model larger than the whole memory limit is served alone
   (:attr:`~gpuserve.repository.ondemand.residency.Room.alone`).
3. **Permanent or not.** When no room can be made and only pinned models stand in the way,
   waiting cannot help: the request is refused at once naming the limit. When busy models
   stand in the way, the request waits (up to its deadline) and the driver asks again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from gpuserve.repository.ondemand.residency import Limits, Resident, Room, make_room
from gpuserve.repository.lifecycle.retry import Failure

#: Refusal reasons (``gpuserve_model_load_refusals_total{reason}``).
BACKOFF = "backoff"
NO_ROOM = "no_room"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do now with a request for a model that is not loaded.

    Attributes:
        action: ``load`` (evict ``room.evict``, then load), ``wait`` (no room yet; ask
            again) or ``refuse`` (503 with ``why`` at once).
        room: The residency answer (what to evict; why blocked; the served-alone warning).
        why: For ``refuse`` and ``wait``: the message a client gets.
        refusal: For ``refuse``: :data:`BACKOFF` or :data:`NO_ROOM`.
        retry_in_s: For a back-off refusal: seconds until the next attempt is due.
    """

    action: Literal["load", "wait", "refuse"]
    room: Room = Room()
    why: str = ""
    refusal: str = ""
    retry_in_s: float = 0.0


def backoff_message(name: str, failure: Failure, retry_in_s: float) -> str:
    """The 503 message of a request refused while ``name``'s back-off lasts."""
    return (
        f"model '{name}' is not ready: its last load failed ({failure.reason or 'no reason'}; "
        f"{failure.attempts} failed attempt(s) in a row); the next attempt is due in "
        f"{max(0.0, retry_in_s):.0f} s, or at once when its files change or an explicit load "
        "asks"
    )


def held_back(name: str, failure: Failure | None, now_s: float) -> Verdict | None:
    """Step 1 alone: the back-off refusal of ``name`` while ``failure`` holds its load back,
    else None (the driver asks it before waiting for the residency lock)."""
    if failure is None:
        return None
    wait_s = failure.retry_at - now_s
    return Verdict(
        "refuse", why=backoff_message(name, failure, wait_s), refusal=BACKOFF, retry_in_s=wait_s
    )


def decide(
    name: str,
    residents: Sequence[Resident],
    need: Mapping[str, int],
    limits: Limits,
    failure: Failure | None,
    now_s: float,
) -> Verdict:
    """What a request for ``name`` (not loaded) gets now.

    Args:
        name: The model.
        residents: Every loaded or loading model.
        need: Its expected memory by device, bytes (see
            :func:`~gpuserve.repository.ondemand.residency.expected_memory`).
        limits: The limits.
        failure: The failure that holds its load back now
            (:meth:`~gpuserve.repository.lifecycle.retry.RetryBackoff.blocking`), or None.
        now_s: Now, seconds on the back-off's clock.

    Returns:
        The verdict (module docstring).
    """
    held = held_back(name, failure, now_s)
    if held is not None:
        return held
    room = make_room(residents, name, need, limits) if limits.limited else Room()
    if room.blocked is None:
        return Verdict("load", room)
    if room.permanent:
        return Verdict("refuse", room, why=room.blocked, refusal=NO_ROOM)
    return Verdict("wait", room, why=room.blocked)
