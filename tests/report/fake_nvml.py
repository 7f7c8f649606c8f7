"""A stand-in for `pynvml` (nvidia-ml-py) with the calls `NvmlReader` makes, for machines without a GPU.

Readings depend on the process's `RANK` (rank r draws 100 + 50 r watts, runs at 60 + r degrees,
clocks 1980 - 100 r MHz, is 90 - 10 r percent busy and, on rank 1 only, is power-capped). GPUs are
found by UUID only (`uuid_of(index)`; GPU 3 holds one MIG instance, `MIG_UUID`), as NVML finds them;
there is no lookup by index. `calls` records every call with the thread that made it.
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
MIG_UUID = "MIG-5c1a55e1-0000-4000-8000-000000000003"
calls: list[tuple[str, str]] = []
initialized = [0]


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _called(name: str) -> None:
    calls.append((name, threading.current_thread().name))


def nvmlInit() -> None:
    _called("nvmlInit")
    initialized[0] += 1


def nvmlShutdown() -> None:
    _called("nvmlShutdown")
    initialized[0] -= 1


class NVMLError(Exception):
    """pynvml's base error (nvmlDeviceGetHandleByUUID raises its NVMLError_NotFound subclass)."""


def uuid_of(index: int) -> str:
    """GPU `index`'s UUID as CUDA reports it (`torch.cuda.get_device_properties(i).uuid`: no prefix)."""
    return f"00000000-1111-2222-3333-{index:012d}"


def nvmlDeviceGetHandleByUUID(uuid: str) -> str:
    _called("nvmlDeviceGetHandleByUUID")
    handles = {f"GPU-{uuid_of(index)}": f"gpu{index}" for index in range(4)} | {MIG_UUID: "gpu3/mig0"}
    if uuid not in handles:
        raise NVMLError("Not Found")
    return handles[uuid]


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle: str) -> str:
    return handle.split("/")[0]


def nvmlDeviceGetPowerUsage(handle: str) -> int:
    _called("nvmlDeviceGetPowerUsage")
    return (100 + 50 * _rank()) * 1000  # milliwatts


def nvmlDeviceGetTemperature(handle: str, sensor: int) -> int:
    assert sensor == NVML_TEMPERATURE_GPU
    return 60 + _rank()


def nvmlDeviceGetClockInfo(handle: str, clock: int) -> int:
    assert clock == NVML_CLOCK_SM
    return 1980 - 100 * _rank()


def nvmlDeviceGetUtilizationRates(handle: str) -> SimpleNamespace:
    return SimpleNamespace(gpu=90 - 10 * _rank(), memory=40)


def nvmlDeviceGetCurrentClocksEventReasons(handle: str) -> int:
    return 0x4 | 0x1 if _rank() == 1 else 0x1  # software power cap (and idle) / idle only
