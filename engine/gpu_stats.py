"""Per-GPU power, temperature, SM clock and memory of the GPUs this process sees, from NVML.

Read by the engine host with its other statistics, so the router's /metrics carries them per replica. On a
machine without NVIDIA GPUs (or without NVML's library) there is nothing to read: an empty list, no error.
"""

from __future__ import annotations

import logging
from typing import Any

from engine.messages import GpuSample

log = logging.getLogger(__name__)


class GpuReader:
    """Opens NVML once; `sample()` reads every visible GPU (a few microseconds each)."""

    def __init__(self, *, enabled: bool = True, nvml: Any = None) -> None:
        """`enabled`: False for a CPU engine (NVML is not opened). `nvml`: the pynvml module (default:
        imported; not installed -> no GPUs)."""
        self._nvml: Any = (nvml if nvml is not None else _import_nvml()) if enabled else None
        self._handles: list[Any] = []
        if self._nvml is None:
            return
        try:
            self._nvml.nvmlInit()
            count = self._nvml.nvmlDeviceGetCount()
            self._handles = [self._nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as exc:  # NVML present but no driver or no device: a CPU machine
            log.debug("NVML unavailable, no GPU metrics: %s", exc)
            self._handles = []

    def sample(self) -> list[GpuSample]:
        nvml = self._nvml
        out = []
        for i, h in enumerate(self._handles):
            try:
                memory = nvml.nvmlDeviceGetMemoryInfo(h)
                out.append(
                    GpuSample(
                        index=i,
                        power_w=nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                        temperature_c=float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
                        sm_clock_mhz=float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
                        memory_used_bytes=int(memory.used),
                        memory_total_bytes=int(memory.total),
                    )
                )
            except Exception as exc:  # one GPU failing to answer must not cost the others' samples
                log.warning("NVML could not read GPU %d: %s", i, exc)
        return out


def _import_nvml() -> Any | None:
    try:
        import pynvml  # type: ignore[import-not-found]  # nvidia-ml-py, installed with CUDA vLLM
    except ImportError:
        return None
    return pynvml
