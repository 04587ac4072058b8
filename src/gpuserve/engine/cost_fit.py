"""A batch's service time as a straight line in its size, fitted from recent batches.

``c(x) = a + b * x`` by exponentially weighted least squares: ``a`` is what each batch costs
whatever its size (a forward call's fixed overhead), ``b`` what each unit adds (a row, or a
padded token). Used by the adaptive batching policy (:mod:`gpuserve.engine.adaptive`, ``x`` in
rows) and the bulk lane's policy (:mod:`gpuserve.engine.bulk_policy`, ``x`` in padded tokens
when batches carry costs). Pure arithmetic: no clock, no I/O.
"""

from __future__ import annotations


class LinearCost:
    """Service seconds of a batch as ``a + b * x``, fitted over recent batches.

    Args:
        decay: Weight kept by older batches at each new one (0-1).
    """

    __slots__ = ("_s0", "_sx", "_sxx", "_sxy", "_sy", "decay", "samples")

    def __init__(self, decay: float = 0.95) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        #: Batches observed.
        self.samples = 0
        self._s0 = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def observe(self, x: float, service_s: float) -> None:
        """One finished batch of size ``x`` (>= 1 counted) that took ``service_s`` seconds."""
        k = self.decay
        x, y = max(float(x), 1.0), max(service_s, 0.0)
        self._s0 = k * self._s0 + 1.0
        self._sx = k * self._sx + x
        self._sy = k * self._sy + y
        self._sxx = k * self._sxx + x * x
        self._sxy = k * self._sxy + x * y
        self.samples += 1

    def coefficients(self) -> tuple[float, float]:
        """The fitted ``(a, b)``, seconds and seconds per unit; both >= 0, (0, 0) before the
        first batch."""
        if self._s0 == 0:
            return 0.0, 0.0
        det = self._s0 * self._sxx - self._sx * self._sx
        if det > 1e-9 * self._s0 * self._sxx:
            b = (self._s0 * self._sxy - self._sx * self._sy) / det
            a = (self._sy - b * self._sx) / self._s0
            if a >= 0 and b >= 0:
                return a, b
            if b < 0:  # bigger batches were not slower: a flat cost
                return self._sy / self._s0, 0.0
        # one batch size seen (or a negative intercept): proportional cost, the cautious guess
        return 0.0, self._sxy / self._sxx if self._sxx else 0.0

    def predict_s(self, x: float) -> float:
        """Predicted service seconds of a batch of size ``x``."""
        a, b = self.coefficients()
        return a + b * x


__all__ = ["LinearCost"]
