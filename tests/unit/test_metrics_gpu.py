"""GPU telemetry against a fake NVML injected into the collector (no GPU needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuserve.metrics import ServerMetrics
from gpuserve.metrics.gpu import NvmlCollector


class NVMLError(Exception):
    pass


class FakeNvml:
    """The subset of pynvml the collector calls, with two GPUs; GPU 1 reads no power."""

    NVMLError = NVMLError

    def __init__(self, count: int = 2, init_error: bool = False) -> None:
        self.count = count
        self.init_error = init_error
        self.inits = self.shutdowns = 0
        self.utilization = [37, 100]
        self.energy_mj = [10_000_000, 20_000_000]

    def nvmlInit(self) -> None:
        if self.init_error:
            raise NVMLError("NVML Shared Library Not Found")
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int):
        return b"NVIDIA H200" if handle == 0 else "NVIDIA L4"  # old pynvml returned bytes

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return f"GPU-0000-{handle}"

    def nvmlDeviceGetUtilizationRates(self, handle: int):
        return SimpleNamespace(gpu=self.utilization[handle], memory=5)

    def nvmlDeviceGetMemoryInfo(self, handle: int):
        return SimpleNamespace(used=(handle + 1) * 2**30, total=(handle + 1) * 80 * 2**30, free=0)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        if handle == 1:
            raise NVMLError("Not Supported")
        return 312_500  # milliwatts

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: int) -> int:
        return 700_000  # milliwatts

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        self.energy_mj[handle] += 1500  # each reading 1.5 J later
        return self.energy_mj[handle]

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        assert sensor == 0  # NVML_TEMPERATURE_GPU
        return 40 + handle


def scrape(collector: NvmlCollector) -> dict[tuple[str, frozenset], float]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


GPU0 = {"gpu": "0", "name": "NVIDIA H200", "uuid": "GPU-0000-0"}
GPU1 = {"gpu": "1", "name": "NVIDIA L4", "uuid": "GPU-0000-1"}


def key(name: str, labels: dict[str, str]) -> tuple[str, frozenset]:
    return name, frozenset(labels.items())


def test_every_gpu_series_with_index_name_and_uuid():
    nvml = FakeNvml()
    values = scrape(NvmlCollector(nvml))
    assert nvml.inits == 1
    assert values[key("gpuserve_gpu_utilization_ratio", GPU0)] == pytest.approx(0.37)
    assert values[key("gpuserve_gpu_utilization_ratio", GPU1)] == 1.0
    assert values[key("gpuserve_gpu_memory_used_bytes", GPU0)] == 2**30
    assert values[key("gpuserve_gpu_memory_total_bytes", GPU1)] == 160 * 2**30
    assert values[key("gpuserve_gpu_power_watts", GPU0)] == 312.5
    assert values[key("gpuserve_gpu_temperature_celsius", GPU1)] == 41
    # GPU 1 cannot read its power: that one series is absent, nothing else is.
    assert key("gpuserve_gpu_power_watts", GPU1) not in values
    assert len(values) == 9


def test_values_are_read_at_scrape_time_and_nvml_is_initialised_once():
    nvml = FakeNvml()
    collector = NvmlCollector(nvml)
    scrape(collector)
    nvml.utilization[0] = 90
    assert scrape(collector)[key("gpuserve_gpu_utilization_ratio", GPU0)] == 0.9
    assert nvml.inits == 1
    collector.close()
    assert nvml.shutdowns == 1
    assert scrape(collector) == {}


@pytest.mark.parametrize("nvml", [FakeNvml(init_error=True), FakeNvml(count=0)])
def test_no_library_or_no_gpu_means_no_series_and_no_error(nvml):
    collector = NvmlCollector(nvml)
    assert not collector.enabled
    assert scrape(collector) == {}


def test_listing_failure_turns_metrics_off():
    nvml = FakeNvml()

    def broken(handle: int) -> str:
        raise NVMLError("GPU is lost")

    nvml.nvmlDeviceGetUUID = broken
    collector = NvmlCollector(nvml)
    assert not collector.enabled and nvml.shutdowns == 1
    assert scrape(collector) == {}


def test_server_metrics_registers_the_injected_nvml():
    metrics = ServerMetrics(nvml=FakeNvml(), process=False)
    text = generate_latest(metrics.registry).decode()
    assert 'gpuserve_gpu_memory_total_bytes{gpu="0",name="NVIDIA H200",uuid="GPU-0000-0"}' in text
    metrics.close()
    assert "gpuserve_gpu_" not in generate_latest(metrics.registry).decode()


def test_the_real_nvml_on_this_machine_never_raises():
    collector = NvmlCollector()  # pynvml: on a CPU machine the library is missing
    values = scrape(collector)
    if collector.enabled:
        assert any(name == "gpuserve_gpu_memory_total_bytes" for name, _ in values)
    else:
        assert values == {}
    collector.close()
