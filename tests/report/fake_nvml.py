"""A stand-in for `pynvml` (nvidia-ml-py) with the calls `NvmlReader` makes, for machines without a GPU.

Readings depend on the process's `RANK` (rank r draws 100 + 50 r watts, runs at 60 + r degrees,
clocks 1980 - 100 r MHz, is 90 - 10 r percent busy and, on rank 1 only, is power-capped). `calls`
records every call with the thread that made it.
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
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


def nvmlDeviceGetHandleByUUID(uuid: str) -> object:
    raise RuntimeError("no UUIDs here")


def nvmlDeviceGetHandleByIndex(index: int) -> str:
    _called("nvmlDeviceGetHandleByIndex")
    return f"gpu{index}"


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
