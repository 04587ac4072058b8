"""GPU telemetry through NVML (``nvidia-ml-py``), read at scrape time.

Series, per GPU, labelled ``gpu`` (NVML index: PCI bus order, which matches CUDA's order under
``CUDA_DEVICE_ORDER=PCI_BUS_ID``), ``name`` and ``uuid``:

* ``gpuserve_gpu_utilization_ratio``: fraction of the last sample period a kernel ran, 0..1
* ``gpuserve_gpu_memory_used_bytes`` / ``gpuserve_gpu_memory_total_bytes``
* ``gpuserve_gpu_power_watts``
* ``gpuserve_gpu_temperature_celsius``

NVML is initialised once, when the collector is made. Without the library, without a driver
or without GPUs the collector yields nothing: no error and no series. A reading a GPU does not
support (power on some boards) is left out for that GPU alone.

The NVML module is injected (``NvmlCollector(nvml=fake)``) so tests run on a CPU against a
fake with the same functions; by default ``pynvml`` from nvidia-ml-py is imported.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

_LABELS = ("gpu", "name", "uuid")
_TEMPERATURE_GPU = 0  # NVML_TEMPERATURE_GPU


@dataclass(slots=True)
class _Gpu:
    index: str
    name: str
    uuid: str
    handle: Any


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvmlCollector(Collector):
    """Per-GPU utilisation, memory, power and temperature.

    Args:
        nvml: An object with pynvml's functions (``nvmlInit``, ``nvmlDeviceGetCount``, ...);
            None imports ``pynvml``.
    """

    def __init__(self, nvml: Any = None) -> None:
        self.nvml: Any = None
        self.gpus: list[_Gpu] = []
        self._lock = threading.Lock()
        if nvml is None:
            try:
                import pynvml

                nvml = pynvml
            except ImportError:
                logger.info("GPU metrics off: nvidia-ml-py is not installed")
                return
        try:
            nvml.nvmlInit()
        except Exception as err:  # no library, no driver: a CPU machine
            logger.info("GPU metrics off: NVML unavailable (%s)", err)
            return
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                self.gpus.append(
                    _Gpu(
                        str(index),
                        _text(nvml.nvmlDeviceGetName(handle)),
                        _text(nvml.nvmlDeviceGetUUID(handle)),
                        handle,
                    )
                )
        except Exception as err:
            logger.warning("GPU metrics off: NVML could not list the GPUs (%s)", err)
            self.gpus = []
            _shutdown(nvml)
            return
        self.nvml = nvml
        if self.gpus:
            logger.info("GPU metrics on: %s", ", ".join(f"{g.index}: {g.name}" for g in self.gpus))

    @property
    def enabled(self) -> bool:
        return self.nvml is not None and bool(self.gpus)

    def describe(self) -> list[Metric]:
        return []  # registering must not call NVML; these names clash with nothing

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            nvml = self.nvml
            if nvml is None or not self.gpus:
                return
            util = GaugeMetricFamily(
                "gpuserve_gpu_utilization_ratio",
                "Fraction of the last sample period during which a kernel ran on the GPU, 0..1.",
                labels=_LABELS,
            )
            used = GaugeMetricFamily(
                "gpuserve_gpu_memory_used_bytes", "GPU memory in use.", labels=_LABELS
            )
            total = GaugeMetricFamily(
                "gpuserve_gpu_memory_total_bytes", "GPU memory installed.", labels=_LABELS
            )
            power = GaugeMetricFamily("gpuserve_gpu_power_watts", "GPU power draw.", labels=_LABELS)
            temperature = GaugeMetricFamily(
                "gpuserve_gpu_temperature_celsius", "GPU core temperature.", labels=_LABELS
            )
            for gpu in self.gpus:
                labels = (gpu.index, gpu.name, gpu.uuid)
                h = gpu.handle
                _read(util, labels, lambda h=h: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100)
                memory = _call(lambda h=h: nvml.nvmlDeviceGetMemoryInfo(h))
                if memory is not None:
                    used.add_metric(labels, float(memory.used))
                    total.add_metric(labels, float(memory.total))
                _read(power, labels, lambda h=h: nvml.nvmlDeviceGetPowerUsage(h) / 1000)
                _read(
                    temperature,
                    labels,
                    lambda h=h: nvml.nvmlDeviceGetTemperature(h, _TEMPERATURE_GPU),
                )
            metrics = [util, used, total, power, temperature]
        yield from (m for m in metrics if m.samples)

    def close(self) -> None:
        """Shut NVML down; later scrapes yield nothing."""
        with self._lock:
            if self.nvml is not None:
                _shutdown(self.nvml)
                self.nvml = None


def _call(read: Any) -> Any:
    try:
        return read()
    except Exception:  # NVMLError_NotSupported and friends: leave the reading out
        return None


def _read(family: GaugeMetricFamily, labels: tuple[str, str, str], read: Any) -> None:
    value = _call(read)
    if value is not None:
        family.add_metric(labels, float(value))


def _shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception:
        logger.debug("nvmlShutdown failed", exc_info=True)
