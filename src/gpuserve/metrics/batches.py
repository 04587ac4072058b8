"""The Batch API's storage gauge: ``gpuserve_batch_storage_bytes``, read at scrape time.

The value is what the state directory holds (stored files and the committed partial outputs
of running batches), as the batch runner last counted it (after each upload, delete, finished
batch and storage sweep); a scrape never touches the job store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry


class BatchStorageCollector(Collector):
    """``gpuserve_batch_storage_bytes``.

    Args:
        read: Returns the bytes stored now (called per scrape; must not block).
    """

    def __init__(self, read: Callable[[], int]) -> None:
        self.read = read

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily("gpuserve_batch_storage_bytes", "")]

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "gpuserve_batch_storage_bytes",
            "Bytes the Batch API's state directory holds: stored files and the partial "
            "outputs of running batches.",
            value=float(self.read()),
        )


def register_batch_storage(registry: CollectorRegistry, read: Callable[[], int]) -> None:
    """Add the storage gauge to ``registry``."""
    registry.register(BatchStorageCollector(read))
