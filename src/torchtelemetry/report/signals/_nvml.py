"""GPU health through NVML (the optional extra `nvml`: nvidia-ml-py): slow or throttled?

A daemon thread (`torchtelemetry-nvml`) reads the rank's GPU once per window, right after the
window is handed over, so the training thread only copies the latest reading (Python floats) into
its slot of a per-rank state that rides the window. Exported under OpenTelemetry's `hw.gpu.*`
(`hw/gpu/...`), min and max over ranks with the ranks holding them, as values:

| quantity | NVML | unit |
| --- | --- | --- |
| `hw/gpu/power` | `nvmlDeviceGetPowerUsage` | watts |
| `hw/gpu/temperature` | `nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)` | celsius |
| `hw/gpu/clock/sm` | `nvmlDeviceGetClockInfo(NVML_CLOCK_SM)` | megahertz |
| `hw/gpu/utilization` | `nvmlDeviceGetUtilizationRates().gpu` | percent |
| `hw/gpu/throttled` | 1 when the clocks are held down by power or thermal limits | |

A reading is at most one window old. The GPU is found by the UUID CUDA reports for the rank's
device (`CUDA_VISIBLE_DEVICES` may renumber devices; NVML's indices ignore it), a MIG instance's
included: its readings are the whole GPU's (power, temperature and clocks belong to the GPU). Without
NVML (the package or the driver), or when NVML knows no device with that UUID, nothing is exported
and one line is logged.
"""

from __future__ import annotations

import importlib
import logging
import threading
from types import ModuleType
from typing import Any

import torch

from torchtelemetry.metric import Metric, MetricKind
from torchtelemetry.report._values import MetricDescriptor, ReportValue
from torchtelemetry.report.signals._base import (
    RankValues,
    Signal,
    SignalContext,
    WindowTiming,
    finite_by_rank,
    highest_rank,
    lowest_rank,
)

__all__ = ["THROTTLE_REASONS", "GpuHealth", "NvmlReader", "cuda_uuid", "gpu_descriptors", "open_nvml"]

logger = logging.getLogger(__name__)

STATE = "hw/gpu/ranks"
QUANTITIES = {
    "power": ("watts", "GPU power draw"),
    "temperature": ("celsius", "GPU temperature"),
    "clock/sm": ("megahertz", "GPU SM clock"),
    "utilization": ("percent", "Time a kernel ran on the GPU over the last sample period"),
    "throttled": ("", "1 when power or thermal limits hold the GPU's clocks down"),
}
THROTTLE_REASONS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
"""NVML clock event reasons that mean a slowed GPU: software power cap (0x4), hardware slowdown
(0x8), software and hardware thermal slowdown (0x20, 0x40), hardware power brake (0x80). Idle,
application clock settings, sync boost and display clocks are not."""


class NvmlReader:
    """Reads one GPU through an NVML module (`pynvml` of nvidia-ml-py, or a stand-in with its API),
    found by `uuid` (`cuda_uuid`); raises `LookupError` when NVML knows no such device."""

    def __init__(self, nvml: ModuleType | Any, uuid: str) -> None:
        self.nvml = nvml
        nvml.nvmlInit()
        try:
            self.handle = _handle(nvml, uuid)
        except BaseException:
            nvml.nvmlShutdown()
            raise
        # nvidia-ml-py 12.535 renamed the throttle reasons "clock event reasons"
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        self._reasons = reasons or nvml.nvmlDeviceGetCurrentClocksThrottleReasons

    def read(self) -> dict[str, float]:
        nvml, handle = self.nvml, self.handle
        return {
            "power": nvml.nvmlDeviceGetPowerUsage(handle) / 1000,
            "temperature": float(
                nvml.nvmlDeviceGetTemperature(handle, getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
            ),
            "clock/sm": float(nvml.nvmlDeviceGetClockInfo(handle, getattr(nvml, "NVML_CLOCK_SM", 1))),
            "utilization": float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            "throttled": float(bool(self._reasons(handle) & THROTTLE_REASONS)),
        }

    def close(self) -> None:
        self.nvml.nvmlShutdown()


def cuda_uuid(device: torch.device) -> str:
    """The UUID CUDA reports for `device` (a MIG instance's own under MIG), without NVML's prefix."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def _handle(nvml: Any, uuid: str) -> Any:
    """The NVML handle of the GPU with `uuid`: a whole GPU ("GPU-..."), or the GPU a MIG instance
    ("MIG-...") lives on. Never by index: NVML numbers GPUs ignoring CUDA_VISIBLE_DEVICES."""
    bare = uuid.removeprefix("GPU-").removeprefix("MIG-")
    try:
        return nvml.nvmlDeviceGetHandleByUUID(f"GPU-{bare}")
    except nvml.NVMLError:
        pass
    try:
        instance = nvml.nvmlDeviceGetHandleByUUID(f"MIG-{bare}")
    except nvml.NVMLError:
        raise LookupError(f"NVML has no GPU or MIG instance with the UUID CUDA reports ({bare})") from None
    return nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(instance)


def open_nvml(device: torch.device, module: str = "pynvml", *, uuid: str | None = None) -> NvmlReader | None:
    """An `NvmlReader` for `device` (found by `uuid`, by default `cuda_uuid(device)`), or None (logged
    once) when NVML cannot be used or knows no such device."""
    try:
        nvml = importlib.import_module(module)
    except ImportError:
        logger.info(
            "Telemetry: no GPU health (hw/gpu/...): pip install 'torchtelemetry[nvml]' (nvidia-ml-py)"
        )
        return None
    try:
        return NvmlReader(nvml, uuid if uuid is not None else cuda_uuid(device))
    except LookupError as error:
        logger.warning("Telemetry: no GPU health (hw/gpu/...) for %s: %s", device, error)
    except Exception as error:  # NVMLError: no driver
        logger.info("Telemetry: no GPU health (hw/gpu/...): NVML unavailable (%s)", error)
    return None


def gpu_descriptors() -> list[MetricDescriptor]:
    """What `GpuHealth` exports."""
    out = []
    for quantity, (unit, description) in QUANTITIES.items():
        for stat in ("min", "max"):
            out.append(
                MetricDescriptor(
                    f"hw/gpu/{quantity}/{stat}", MetricKind.GAUGE, unit, f"{description}, {stat} over ranks"
                )
            )
            out.append(
                MetricDescriptor(
                    f"hw/gpu/{quantity}/{stat}_rank", description=f"Rank with the {stat} {quantity}"
                )
            )
    return out


class GpuHealth(Signal):
    """NVML readings per rank, reduced (see the module); without a reader (no CUDA, no NVML) it
    exports nothing and starts no thread."""

    name = "gpu"

    def __init__(self, context: SignalContext, reader: NvmlReader | None) -> None:
        super().__init__(context)
        self.reader = reader
        self.ranks = RankValues(context.world_size, context.rank, tuple(QUANTITIES)).to(context.device)
        self._latest: dict[str, float] | None = None
        self._wanted = threading.Event()
        self._stopped = False
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="torchtelemetry-nvml", daemon=True)
        if reader is not None:
            self._wanted.set()
            self._thread.start()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self._stopped:
                return
            try:
                assert self.reader is not None  # the thread runs only with one
                self._latest = self.reader.read()
            except Exception as error:
                if not self._failed:
                    self._failed = True
                    logger.warning("Telemetry: NVML read failed (%s); GPU health is not updated", error)

    def metrics(self) -> dict[str, Metric]:
        return {STATE: self.ranks} if self.reader is not None else {}

    def descriptors(self) -> list[MetricDescriptor]:
        return gpu_descriptors() if self.reader is not None else []

    @staticmethod
    def cuda_descriptors() -> list[MetricDescriptor]:
        return gpu_descriptors()

    def flush(self, duration_s: float, *, final: bool = False) -> None:
        if self.reader is None:
            return
        latest = self._latest
        if latest is not None:
            for index, quantity in enumerate(QUANTITIES):
                self.ranks.write(index, latest[quantity])
        self._wanted.set()

    def derive(self, window: dict[str, ReportValue], timing: WindowTiming) -> None:
        for quantity in QUANTITIES:
            by_rank = finite_by_rank(window.pop(f"{STATE}/{quantity}", None))
            if by_rank:
                low, high = lowest_rank(by_rank), highest_rank(by_rank)
                window[f"hw/gpu/{quantity}/min"], window[f"hw/gpu/{quantity}/min_rank"] = (
                    by_rank[low],
                    float(low),
                )
                window[f"hw/gpu/{quantity}/max"], window[f"hw/gpu/{quantity}/max_rank"] = (
                    by_rank[high],
                    float(high),
                )

    def close(self) -> None:
        if self.reader is None:
            return
        self._stopped = True
        self._wanted.set()
        self._thread.join(timeout=10.0)
        try:
            self.reader.close()
        except Exception as error:
            logger.debug("Telemetry: nvmlShutdown failed: %s", error)
