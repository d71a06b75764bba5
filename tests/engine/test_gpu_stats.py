"""GPU readings from NVML: every visible GPU's power, temperature, SM clock and memory; on a machine without
NVIDIA GPUs, or for a CPU engine, nothing and no error. NVML itself is replaced by a stand-in here (this
machine has no GPU); on GPU machines scripts/gpu_smoke.sh runs the real one."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from engine.gpu_stats import GpuReader


class FakeNvml:
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    def __init__(self, gpus: int, *, init_error: bool = False, broken: int | None = None) -> None:
        self.gpus, self.init_error, self.broken = gpus, init_error, broken

    def nvmlInit(self) -> None:
        if self.init_error:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetCount(self) -> int:
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        if h == self.broken:
            raise RuntimeError("GPU is lost")
        return 650_000 + h  # milliwatts

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return 55 + h

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        return 1980

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(used=10 << 30, total=141 << 30)


def test_every_visible_gpu_is_read() -> None:
    samples = GpuReader(nvml=FakeNvml(2)).sample()
    assert [s.index for s in samples] == [0, 1]
    assert samples[1].power_w == 650.001 and samples[1].temperature_c == 56.0
    assert (samples[0].sm_clock_mhz, samples[0].memory_total_bytes) == (1980.0, 141 << 30)


def test_no_nvml_or_no_driver_means_no_samples_and_no_error() -> None:
    assert GpuReader(nvml=FakeNvml(2, init_error=True)).sample() == []
    assert GpuReader(enabled=False, nvml=FakeNvml(2)).sample() == []  # a CPU engine does not open NVML
    assert GpuReader().sample() == []  # this machine: no pynvml, or no GPU


def test_a_gpu_that_does_not_answer_costs_only_its_own_sample() -> None:
    assert [s.index for s in GpuReader(nvml=FakeNvml(3, broken=1)).sample()] == [0, 2]
