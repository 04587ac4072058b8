"""How long a batch may regather when an instance frees: the window of ``early_dispatch``.

When an instance finishes a batch, the dynamic batcher holds the next batch (the rows queued
then, or the first to arrive) for a short window so that the clients of the finished batch,
just answered, can join it (a closed loop sends again at once; see
:mod:`gpuserve.engine.batcher`). The window is the smaller of ``max_queue_delay`` and a tenth
of the finished batch's time, so a batch waits for company no longer than the user's delay
allows.

That cap is too short where the answers and the returning requests go through an HTTP layer
that shares the CPU with the model (a server on one core): the event loop needs about a
quarter of a millisecond of CPU per request to answer one and admit the next, so the 17
answered clients of a 60 ms batch take some 4 ms to come back, a 2 ms window closes with two
of them, and a closed loop of 32 clients settles into batches of about 17 and 15 instead of
one batch of 32 (measured with ``benchmarks/mixed_length.py`` on one AVX-512/AMX core:
short sentences at 32 clients, 17.4 rows per batch; with the probe below, 31.7 rows per batch
and 5% more requests per second, the same at 8 clients).

:class:`ReturnProbe` watches whether answered clients do come back: after each finished batch
it counts the rows that arrive within a tenth of that batch's time. When at least half as
many rows as the batch answered (and at least :data:`MIN_RETURNS`) arrive that soon after two
batches in a row, the load is a closed loop (clients waiting on their answers), and the next
window may last the whole tenth of the batch, beyond ``max_queue_delay``, still ending as
soon as the expected rows are queued. Under open-loop
traffic below saturation arrivals do not follow completions, far fewer rows arrive in a tenth
of a batch than it answered (at saturation about a tenth), and the window keeps the delay's
bound. A delay of 0 never opens a window.

Waiting pays only where the wait costs the model nothing: the runner allows the longer window
(``beyond_delay``) only for a version with one instance, on a CPU, whose compute threads take
every core the process may use, so that the event loop answering and admitting the returning
clients runs on the model's cores (:func:`shares_cpu_with_event_loop`). With the event loop on
a core of its own, the instance would idle through the window; with several instances one
would wait for clients that another's batch holds; adaptive batching sets its delay from a
latency target. All of those keep the delay's bound.

A pure object: times are seconds on the caller's monotonic clock.
"""

from __future__ import annotations

#: A window shorter than an event-loop timer tick (1 ms with uvloop/libuv) would wait a whole
#: tick: not worth it for batches that fast.
MIN_WINDOW_S = 0.001
#: Share of a batch's time the window may last, and within which returns are counted.
WINDOW_SHARE = 0.1
#: Rows arriving within the probe, per row answered, that mark a closed loop ...
RETURN_SHARE = 0.5
#: ... and at least this many (one Poisson arrival after a batch of one proves nothing).
MIN_RETURNS = 4


class ReturnProbe:
    """Whether answered clients come back at once, and the regather window that follows.

    Args:
        beyond_delay: Let the window pass ``max_queue_delay`` once returns are seen. False
            keeps the delay's bound always (adaptive batching, which plans the delay against
            a latency target).
    """

    __slots__ = ("_answered", "_arrived", "_last_seen", "_until", "beyond_delay", "returns_seen")

    def __init__(self, beyond_delay: bool = True) -> None:
        self.beyond_delay = beyond_delay
        #: The clients of the two previous finished batches came back within their probes
        #: (a closed loop; one probe alone is too easily met by chance).
        self.returns_seen = False
        self._last_seen = False
        self._until = float("-inf")  # end of the current probe
        self._answered = 0  # rows the probed batch answered
        self._arrived = 0  # rows that arrived within the probe

    def arrived(self, at_s: float, rows: int) -> None:
        """A request of ``rows`` rows was queued at ``at_s``."""
        if at_s <= self._until:
            self._arrived += rows

    def window(self, now: float, service_s: float, rows: int, max_queue_delay_s: float) -> float:
        """An instance finished a batch of ``rows`` rows that took ``service_s`` seconds, at
        ``now``: judge the previous probe, start a new one, and return how long the next
        batch may regather (seconds; 0: no window). ``max_queue_delay_s`` is the batcher's
        delay now (an adaptive policy may change it): the window's bound until returns are
        seen."""
        if self._answered:
            seen = self._arrived >= max(MIN_RETURNS, RETURN_SHARE * self._answered)
            self.returns_seen = seen and self._last_seen
            self._last_seen = seen
        share = WINDOW_SHARE * service_s
        self._until = now + share
        self._answered = rows
        self._arrived = 0
        if max_queue_delay_s <= 0:
            return 0.0
        beyond = self.beyond_delay and self.returns_seen
        window = share if beyond else min(max_queue_delay_s, share)
        return window if window >= MIN_WINDOW_S else 0.0


def shares_cpu_with_event_loop(instances: int, on_gpu: bool, threads: int, cpus: int) -> bool:
    """Whether a version's one CPU instance computes on every core the process may use, so
    that the event loop competes with it (``threads``: the model's compute threads; ``cpus``:
    the cores the process may run on)."""
    return instances == 1 and not on_gpu and threads >= cpus >= 1


__all__ = [
    "MIN_RETURNS",
    "MIN_WINDOW_S",
    "RETURN_SHARE",
    "WINDOW_SHARE",
    "ReturnProbe",
    "shares_cpu_with_event_loop",
]
