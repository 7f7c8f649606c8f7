"""GPU health through NVML: the adapter against a stand-in module here, the real one where CUDA is."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from tests.distributed import run_ranks
from tests.report import fake_nvml
from tests.report.windows import collect_window, context
from torchtelemetry.report.signals import GpuHealth, SignalSet, builtin_signals, open_nvml


def _gpu_health(rank: int, world_size: int) -> tuple[dict, list]:
    reader = open_nvml(torch.device("cpu"), module="tests.report.fake_nvml", uuid=fake_nvml.uuid_of(rank))
    assert reader is not None
    gpu = GpuHealth(context(world_size, rank), reader)
    signals = SignalSet([gpu])
    deadline = time.monotonic() + 30
    while gpu._latest is None and time.monotonic() < deadline:  # the first reading, off this thread
        time.sleep(0.01)
    window = collect_window(signals)
    signals.close()
    return window, list(fake_nvml.calls)


@pytest.mark.timeout(120)
def test_readings_are_reduced_over_ranks_with_the_ranks_as_values_and_read_off_the_training_thread() -> None:
    (window, calls), _, _ = run_ranks(_gpu_health, 3)
    assert window["hw/gpu/power/min"] == 100.0 and window["hw/gpu/power/min_rank"] == 0.0
    assert window["hw/gpu/power/max"] == 200.0 and window["hw/gpu/power/max_rank"] == 2.0
    assert window["hw/gpu/temperature/max"] == 62.0 and window["hw/gpu/temperature/max_rank"] == 2.0
    assert window["hw/gpu/clock/sm/min"] == 1780.0 and window["hw/gpu/clock/sm/min_rank"] == 2.0
    assert window["hw/gpu/utilization/max"] == 90.0 and window["hw/gpu/utilization/max_rank"] == 0.0
    # idle is not throttling; a power cap is
    assert window["hw/gpu/throttled/max"] == 1.0 and window["hw/gpu/throttled/max_rank"] == 1.0
    assert window["hw/gpu/throttled/min"] == 0.0
    readers = {thread for name, thread in calls if name == "nvmlDeviceGetPowerUsage"}
    assert readers == {"torchtelemetry-nvml"}
    assert calls[-1][0] == "nvmlShutdown"


@pytest.mark.parametrize(
    ("uuid", "handle"),
    [
        (fake_nvml.uuid_of(2), "gpu2"),  # as CUDA reports it
        (f"GPU-{fake_nvml.uuid_of(1)}", "gpu1"),  # as NVML writes it
        (fake_nvml.MIG_UUID.removeprefix("MIG-"), "gpu3"),  # a MIG instance: the GPU it lives on
    ],
    ids=["cuda form", "nvml form", "mig instance"],
)
def test_the_gpu_is_the_one_with_the_uuid_cuda_reports(uuid: str, handle: str) -> None:
    """CUDA_VISIBLE_DEVICES=2 makes NVML's GPU 2 CUDA's device 0: only the UUID names the same GPU."""
    reader = open_nvml(torch.device("cuda", 0), module="tests.report.fake_nvml", uuid=uuid)
    assert reader is not None and reader.handle == handle
    reader.close()


def test_a_gpu_nvml_does_not_know_exports_nothing_and_one_line_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No guess by CUDA index (NVML's indices ignore CUDA_VISIBLE_DEVICES: another GPU's readings)."""
    initialized = fake_nvml.initialized[0]
    with caplog.at_level(logging.INFO, logger="torchtelemetry.report.signals._nvml"):
        reader = open_nvml(torch.device("cuda", 0), module="tests.report.fake_nvml", uuid="0badc0de-0000")
    assert reader is None
    assert len(caplog.records) == 1
    assert "no GPU health (hw/gpu/...) for cuda:0" in caplog.text and "0badc0de-0000" in caplog.text
    assert fake_nvml.initialized[0] == initialized  # NVML shut down again


def test_without_nvml_nothing_is_exported_and_one_line_says_why(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="torchtelemetry.report.signals._nvml"):
        assert open_nvml(torch.device("cuda", 0), module="tests.report.no_such_nvml") is None
    assert len(caplog.records) == 1 and "pip install 'torchtelemetry[nvml]'" in caplog.text
    signals = builtin_signals(context(), nvml=True)
    (gpu,) = [signal for signal in signals if isinstance(signal, GpuHealth)]  # CPU training: no GPU to read
    assert gpu.reader is None and not gpu.metrics() and not gpu.descriptors()
    assert not gpu._thread.is_alive()  # no reader, no thread
    gpu.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="NVML reads a real GPU")
def test_the_real_nvml_reads_this_gpu() -> None:
    pytest.importorskip("pynvml")
    reader = open_nvml(torch.device("cuda", torch.cuda.current_device()))
    assert reader is not None
    reading = reader.read()
    reader.close()
    assert 0 < reading["power"] < 2000 and 0 < reading["temperature"] < 120
    assert reading["clock/sm"] > 0 and 0 <= reading["utilization"] <= 100
    assert reading["throttled"] in (0.0, 1.0)
