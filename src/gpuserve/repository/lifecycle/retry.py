"""When a version that failed to load is tried again, its folder unchanged.

One record and one back-off for every path that loads: a ``poll``, a request under load on
demand (which is answered at once with the last error while the back-off lasts, see
:mod:`gpuserve.repository.ondemand.demand`) and an explicit ``load`` (which always tries at once and
counts as an attempt).

A load can fail for a reason that goes away by itself (a file still being copied by another
tool, a device that was busy, a library that failed at first use), so a poll does not wait
for the folder to change forever: a failed version is tried again after a back-off of
``base_s`` seconds, doubled after each failure of the same folder content, up to ``max_s``.
A changed folder is tried at the next scan as before, and an explicit ``load`` always tries
at once. Pure bookkeeping on an injected monotonic clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

#: First wait after a failure, seconds; doubled per further failure of the same content.
DEFAULT_BASE_S = 60.0
#: Longest wait between two tries, seconds.
DEFAULT_MAX_S = 1800.0


@dataclass(frozen=True, slots=True)
class Failure:
    """The last failed load of one version.

    Attributes:
        fingerprint: The folder content that failed.
        attempts: Failed loads of that content in a row.
        retry_at: When a poll or a request may try again (monotonic seconds).
        reason: Why it failed (the load error).
        config: The model configuration it failed with (its JSON), or "" when not known.
    """

    fingerprint: Hashable
    attempts: int
    retry_at: float
    reason: str = ""
    config: str = ""


class RetryBackoff:
    """Failed loads by (model, version), and when each may be tried again.

    Args:
        base_s: First wait after a failure, seconds.
        max_s: Longest wait, seconds.
        clock: Monotonic seconds (tests pass a fake clock).
    """

    def __init__(
        self,
        base_s: float = DEFAULT_BASE_S,
        max_s: float = DEFAULT_MAX_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.clock = clock
        self._failures: dict[tuple[str, int], Failure] = {}

    def failed(
        self, model: str, version: int, fingerprint: Hashable, reason: str = "", config: str = ""
    ) -> float:
        """Record a failed load (``reason``: the error; ``config``: the configuration's JSON
        it failed with); returns the wait before the next try, seconds."""
        key = (model, version)
        last = self._failures.get(key)
        same = last is not None and last.fingerprint == fingerprint and last.config == config
        attempts = last.attempts + 1 if last is not None and same else 1
        wait_s = min(self.max_s, self.base_s * 2 ** (attempts - 1))
        self._failures[key] = Failure(fingerprint, attempts, self.clock() + wait_s, reason, config)
        return wait_s

    def due(self, model: str, version: int, fingerprint: Hashable) -> bool:
        """Whether a poll should try ``version`` again: its back-off has passed, or its
        content is not the one that failed (or no failure is recorded)."""
        last = self._failures.get((model, version))
        if last is None or last.fingerprint != fingerprint:
            return True
        return self.clock() >= last.retry_at

    def attempts(self, model: str, version: int) -> int:
        """Failed loads in a row of ``version``'s current content (0 when none)."""
        last = self._failures.get((model, version))
        return last.attempts if last is not None else 0

    def forget(self, model: str, version: int) -> None:
        """The version loaded (or left the repository): start again from ``base_s``."""
        self._failures.pop((model, version), None)

    def has_failures(self, model: str) -> bool:
        """Whether any version of ``model`` has a failure recorded."""
        return any(name == model for name, _v in self._failures)

    def blocking(
        self,
        model: str,
        fingerprints: Mapping[int, Hashable],
        config: Callable[[], str] | None = None,
    ) -> Failure | None:
        """The failure that holds back a load of ``model`` now, or None: every version in
        ``fingerprints`` (version -> its folder's content now; the versions a load would
        load) failed with that same content and its back-off has not passed. With
        ``config`` (the configuration's JSON now, asked only when needed), a failure
        recorded with another configuration does not hold it back either. The one due
        soonest is returned (it names the error and when the next attempt is due)."""
        if not fingerprints:
            return None
        now = self.clock()
        held: list[Failure] = []
        for v, fingerprint in fingerprints.items():
            last = self._failures.get((model, v))
            if last is None or last.fingerprint != fingerprint or now >= last.retry_at:
                return None
            held.append(last)
        if config is not None:
            current = config()
            if any(f.config and f.config != current for f in held):
                return None
        return min(held, key=lambda f: f.retry_at)
