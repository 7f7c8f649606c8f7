"""Model FLOPs utilization and achieved TFLOP/s, as torchtitan computes them, and accelerators' peaks."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

__all__ = ["PEAK_FLOPS", "ModelFlops", "model_flops", "peak_flops_of"]

logger = logging.getLogger(__name__)

PEAK_FLOPS: dict[str, float] = {
    "A100": 312e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H200": 989e12,
    "B200": 2.25e15,
    "MI300X": 1300e12,
    "MI325X": 1300e12,
    "MI250X": 191.5e12,
    "L40S": 362e12,
}
"""Dense (no sparsity) BF16 peak FLOP/s of one accelerator, by a part of its device name; the
first key found in `torch.cuda.get_device_name()` wins (so "H100 NVL" before "H100", which covers
the SXM parts). The figures are torchtitan's `get_peak_flops` (torchtitan/tools/utils.py), from
the vendors' data sheets; for anything else pass `TelemetryConfig.peak_flops`."""


def peak_flops_of(device_name: str) -> float | None:
    """Peak dense BF16 FLOP/s of the accelerator named `device_name` (`torch.cuda.get_device_name()`)
    from `PEAK_FLOPS`, or None when it is not listed."""
    for key, peak in PEAK_FLOPS.items():
        if key.lower() in device_name.lower():
            return peak
    return None


@dataclass(frozen=True, slots=True)
class ModelFlops:
    """What `train/tflops_per_second` and `train/mfu` are computed from (see `model_flops`)."""

    per_unit: float
    """FLOPs of one training token, or of one sample when `per_sample`."""
    per_sample: bool
    """`per_unit` counts FLOPs per sample (fed by `step(samples=)`) instead of per token."""
    peak: float | None
    """Peak FLOP/s of one device; None exports no MFU."""

    @classmethod
    def resolve(
        cls,
        per_token: float | None,
        per_sample: float | None,
        peak: float | None,
        device: torch.device,
        *,
        warn: bool = True,
    ) -> ModelFlops | None:
        """From `TelemetryConfig`: None without FLOPs per token or sample; the peak, if not given, from
        `PEAK_FLOPS` by the CUDA device's name (no MFU when it is not listed, and a warning if `warn`:
        the rank that exports, not every rank)."""
        per_unit = per_token or per_sample
        if per_unit is None:
            return None
        if peak is None:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
            peak = peak_flops_of(name)
            if peak is None and warn:
                logger.warning(
                    "Telemetry: no peak FLOP/s known for device %r, so train/mfu is not exported; "
                    "pass TelemetryConfig.peak_flops (FLOP/s of one device)",
                    name,
                )
        return cls(per_unit=per_unit, per_sample=per_sample is not None, peak=peak)


def model_flops(
    work: float, duration_s: float, world_size: int, flops_per_unit: float, peak_flops: float | None
) -> dict[str, float]:
    """`train/tflops_per_second` and `train/mfu` (percent) of one window, per device.

    `work` is what the ranks trained on in the window, summed over ranks (tokens, or samples when
    FLOPs are given per sample), each counted once; `duration_s` the window's host wall time.
    This is torchtitan's formula (torchtitan/train.py, components/metrics.py `MetricsProcessor.log`):

        tps = ntokens_since_last_log / (time_delta * non_data_parallel_size)   # per device
        mfu = 100 * num_flops_per_token * tps / gpu_peak_flops                 # PaLM's MFU, in %
        tflops = num_flops_per_token * tps / 1e12

    with the per-device rate taken as `work / (duration_s * world_size)`, `world_size` being the
    ranks `Telemetry` reduces over. That is torchtitan's `tps` when the group holds every device
    of the job and every token is counted once across it: with tensor or context parallelism,
    count it on one rank of each model-parallel group (or divide by the degree). With a group
    of the data-parallel ranks only, the rate is per model replica, not per device.
    """
    per_device = work / (duration_s * world_size)
    out = {"tflops_per_second": flops_per_unit * per_device / 1e12}
    if peak_flops is not None:
        out["mfu"] = 100 * flops_per_unit * per_device / peak_flops
    return out
