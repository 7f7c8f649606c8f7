"""The training dashboard's Health row (docs/signals.md): phases and stragglers, non-finite values and
spikes, memory over ranks, goodput, GPU health. Every name is read from the signal objects."""

from __future__ import annotations

from typing import Any

from layers import layer_panels
from panels import _thresholds, metric, selected, spread, stat, targets, timeseries


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": {"w": 24, "h": 1}}


def by(labels: str, path: str, aggregation: str = "max") -> str:
    """`aggregation` of a built-in signal's series per run and `labels` (one copy per route)."""
    return f"{aggregation} by (job, run{labels}) ({selected(metric(path))})"


GPU_QUANTITIES = ("power", "temperature", "clock/sm", "utilization")


def increase_by(labels: str, path: str) -> str:
    """The increase per interval of a built-in counter per run and `labels` (one copy per route)."""
    return f"max by (job, run{labels}) (increase({selected(metric(path))}[$__rate_interval]))"


def health_panels() -> list[dict[str, Any]]:
    """The health row: phases and stragglers, non-finite values and spikes, memory, goodput, GPU
    (docs/signals.md). Ranks are values: the slowest rank is a number, not a label."""
    phase, metric_label = ", phase", ", metric"
    return [
        row("Health: where the time goes, stragglers, non-finite values, memory, goodput, GPU"),
        timeseries(
            "Where the time goes: share of the step per phase",
            "Percent of each window's wall time the median rank spent in each phase (with "
            "telemetry.phase(name); the data wait is the phase 'data'). Nested phases overlap.",
            "percent",
            targets((by(phase, "train/phases/share"), "{{run}} {{phase}}")),
        ),
        timeseries(
            "Phase time over ranks: min / median / max",
            "Seconds per step in each phase: the fastest, the median and the slowest rank.",
            "s",
            targets(
                *(
                    (by(phase, f"train/phases/{stat}"), "{{run}} {{phase}} " + stat)
                    for stat in ("min", "median", "max")
                )
            ),
        ),
        timeseries(
            "Gradient all-reduce wait over ranks: min / median / max",
            "Seconds per step each rank's backward waited for the gradient all-reduce after its last "
            "gradient (watch_gradient_sync): "
            "the ranks that wait for a straggler there the longest; the straggler waits least.",
            "s",
            spread("torchtelemetry_train_sync_wait", "seconds"),
        ),
        timeseries(
            "Straggler score per phase",
            "Slowest rank's time in the phase over the other ranks' median (the phase that holds the "
            "gradient all-reduce less the wait there, not scored without it), the largest ratio of a "
            "rank's time to its own best window, and the run's threshold from its window-to-window "
            "spread (at least 1.2). In synchronous training the step time cannot show a straggler; "
            "its phase does. RankStraggler fires above the threshold at a cost over 5 % of the step.",
            "none",
            targets(
                (by(phase, "train/straggler/score"), "{{run}} {{phase}} vs others"),
                (by(phase, "train/straggler/own_best_score"), "{{run}} {{phase}} vs own best"),
                (by(phase, "train/straggler/threshold"), "{{run}} {{phase}} threshold"),
            ),
            threshold_line=1.2,
        ),
        timeseries(
            "Straggler cost per phase",
            "Percent of the step the other ranks wait for the slowest rank in each phase: its time "
            "there less the others' median (their work only), over the step. RankStraggler and the "
            "stragglers' list count a rank from 5 %.",
            "percent",
            targets((by(phase, "train/straggler/cost"), "{{run}} {{phase}}")),
            threshold_line=5,
        ),
        timeseries(
            "Slowest rank per phase",
            "Rank ids (values, not labels): the highest straggler score in each phase, and the "
            "rank furthest from its own best.",
            "none",
            targets(
                (by(phase, "train/straggler/rank"), "{{run}} {{phase}} vs others"),
                (by(phase, "train/straggler/own_best_rank"), "{{run}} {{phase}} vs own best"),
            ),
        ),
        stat(
            "Slowest ranks",
            "The stragglers (up to straggler_top_k): ranks above their phase's threshold two "
            "windows running, at a cost over 5 % of the step, place 1 the slowest: rank ids and "
            "their scores.",
            "none",
            targets(
                (by(", place", "train/straggler/top_rank"), "#{{place}} rank"),
                (by(", place", "train/straggler/top_score"), "#{{place}} score"),
            ),
            decimals=2,
        ),
        stat(
            "Fastest, median and slowest rank per phase",
            "The ranks holding the shortest, the median and the longest time per step in each phase "
            "(a straggler's capture takes the median rank of its phase as reference).",
            "none",
            targets(
                (by(phase, "train/phases/min_rank"), "{{phase}} fastest"),
                (by(phase, "train/phases/median_rank"), "{{phase}} median"),
                (by(phase, "train/phases/max_rank"), "{{phase}} slowest"),
            ),
            decimals=0,
        ),
        timeseries(
            "Non-finite values and spikes per interval",
            "NaN and Inf fed to each watched metric (every *loss by default), counted exactly on the "
            "device whatever its nan_policy (NonFiniteValues fires on any), and windows scoring above "
            "spike_sigma (LossSpike).",
            "short",
            targets(
                (increase_by(metric_label, "train/nonfinite/count"), "{{run}} {{metric}} non-finite"),
                (increase_by(metric_label, "train/spike/count"), "{{run}} {{metric}} spikes"),
            ),
        ),
        stat(
            "First non-finite value: rank and step",
            "The lowest rank that saw the first NaN or Inf of each watched metric, and the last step "
            "of that window (empty until one).",
            "none",
            targets(
                (by(metric_label, "train/nonfinite/first_rank"), "{{metric}} rank"),
                (by(metric_label, "train/nonfinite/first_step"), "{{metric}} step"),
            ),
            decimals=0,
        ),
        timeseries(
            "Spike score",
            "Standard deviations of each watched metric's window value above the mean of its recent "
            "windows; LossSpike fires above spike_sigma (6).",
            "none",
            targets((by(metric_label, "train/spike/score"), "{{run}} {{metric}}")),
            threshold_line=6,
        ),
        timeseries(
            "Resident memory: largest rank",
            "Resident set of the process on the rank with the most (every device).",
            "bytes",
            targets((by("", "train/memory/rss/max"), "{{run}}")),
        ),
        timeseries(
            "CUDA memory over ranks: allocated, reserved, fragmentation, headroom",
            "Most allocated, reserved and reserved-but-unallocated memory of any rank, and the least "
            "free device memory (MemoryHeadroomLow below 2 GiB); CUDA runs only.",
            "bytes",
            targets(
                (by("", "train/memory/allocated/max"), "{{run}} allocated (max)"),
                (by("", "train/memory/reserved/max"), "{{run}} reserved (max)"),
                (by("", "train/memory/fragmentation/max"), "{{run}} fragmentation (max)"),
                (by("", "train/memory/headroom/min", "min"), "{{run}} headroom (min)"),
            ),
        ),
        stat(
            "Ranks holding the memory extremes",
            "The rank with the largest resident set and, on CUDA, with the most allocated, reserved "
            "and fragmented memory, the least headroom, and the most allocator retries and OOMs in "
            "the window (their counts: the panel 'CUDA allocator: retries and OOMs').",
            "none",
            targets(
                *(
                    (by("", f"train/memory/{quantity}/max_rank"), f"{quantity}")
                    for quantity in ("rss", "allocated", "reserved", "fragmentation", "alloc_retries", "ooms")
                ),
                (by("", "train/memory/headroom/min_rank"), "least headroom"),
            ),
            decimals=0,
        ),
        stat(
            "Goodput",
            "Share of the wall time since the run's first start whose progress reached a checkpoint "
            "(telemetry.checkpoint_saved); GoodputLow fires under 90 %. Not exported before the "
            'run\'s first durable checkpoint: "no checkpoint yet".',
            "percentunit",
            targets((by("", "train/goodput", "min"), "{{run}}")),
            thresholds=_thresholds(("red", None), ("orange", 0.8), ("green", 0.9)),
            no_value="no checkpoint yet",
        ),
        timeseries(
            "Goodput: productive and wall time",
            "Wall time since the run's first start (across restarts), and the part of it whose "
            "progress reached a checkpoint.",
            "s",
            targets(
                (by("", "train/goodput/wall_time"), "{{run}} wall"),
                (by("", "train/goodput/productive_time"), "{{run}} productive"),
            ),
        ),
        timeseries(
            "Restarts and recomputed steps",
            "Restarts from a checkpoint and the steps trained again after them, per interval.",
            "short",
            targets(
                (increase_by("", "train/goodput/restarts"), "{{run}} restarts"),
                (increase_by("", "train/goodput/recomputed_steps"), "{{run}} recomputed steps"),
            ),
        ),
        timeseries(
            "GPU power, temperature, SM clock, utilization: min / max over ranks",
            "NVML readings of every rank's GPU (extra nvml), at most one window old: watts, degrees "
            "Celsius, MHz, percent (CUDA runs only).",
            "none",
            targets(
                *(
                    (by("", f"hw/gpu/{quantity}/{stat}", stat), "{{run}} " + f"{quantity} {stat}")
                    for quantity in GPU_QUANTITIES
                    for stat in ("min", "max")
                )
            ),
        ),
        stat(
            "GPU: ranks at the extremes, throttling",
            "The ranks with the lowest and highest reading of each quantity, and whether any rank's "
            "GPU is held down by power or thermal limits (GpuThrottled after 10 minutes; CUDA only).",
            "none",
            targets(
                *(
                    (by("", f"hw/gpu/{quantity}/{stat}_rank", stat), f"{quantity} {stat} rank")
                    for quantity in (*GPU_QUANTITIES, "throttled")
                    for stat in ("min", "max")
                ),
                (by("", "hw/gpu/throttled/max"), "throttled (any rank)"),
                (by("", "hw/gpu/throttled/min", "min"), "throttled (every rank)"),
            ),
            decimals=0,
        ),
        row("Layers: gradient and parameter norms per layer, where a NaN was born"),
        *layer_panels(),
        *hang_panels(),
        *capture_panels(),
        row("Your metrics: every gauge, counter and histogram of the run's metric tree"),
    ]


def hang_panels() -> list[dict[str, Any]]:
    """The Hangs row: which rank stopped, where, and for how long (exported by the exporting rank's
    monitor while the training threads are stuck; RankHung fires on it)."""
    return [
        row("Hangs: the rank every other rank waits for, its step and phase"),
        stat(
            "Hang: rank, step, lost ranks, stack file",
            "The rank furthest behind once a rank made no progress for hang_after_s, the step it "
            "stopped in, the ranks whose heartbeat stopped altogether (died), and the file its stacks "
            "were written to (train/hang/dump, label file). Rank and step keep naming the last hang "
            "after it clears. Unwatched ranks never joined the heartbeat store; refused values are "
            "heartbeats that failed their authenticator (forged, malformed or replayed).",
            "none",
            targets(
                (by("", "train/hang/rank"), "rank"),
                (by("", "train/hang/step"), "step"),
                (by("", "train/hang/lost_ranks"), "lost ranks"),
                (by(", file", "train/hang/dump"), "stacks of rank {{file}}"),
                (by("", "train/hang/unwatched_ranks"), "unwatched ranks"),
                (by("", "train/hang/rejected_values"), "refused values"),
            ),
            decimals=0,
        ),
        timeseries(
            "Hang: seconds since the rank furthest behind moved, by the phase it stopped in",
            "0 while every rank makes progress; during a hang, the seconds since the rank furthest "
            "behind last entered or left a phase or step, labelled with that phase.",
            "s",
            targets(
                (by("", "train/hang/seconds"), "{{run}} seconds"),
                (
                    f"{by(', phase', 'train/hang/phase')} * on (job, run) group_left "
                    f"{by('', 'train/hang/seconds')}",
                    "{{run}} stopped in {{phase}}",
                ),
            ),
        ),
    ]


def capture_panels() -> list[dict[str, Any]]:
    """The Captures row: where the evidence of each verdict naming a rank is (docs/signals.md,
    Captures; the alerts that name a rank give its capture's directory too)."""
    return [
        row("Captures: the profile, stacks and memory of the rank a verdict named"),
        stat(
            "Capture: latest rank, step, directories",
            "The rank the latest capture named (a straggler, the first non-finite value, a hang, your "
            "request) and the step it began after; one series per capture, labelled with the "
            "directory of the rank it named in dump_dir (train/capture/file, label file), from the "
            "window it began with; a reference rank's directory is the same name with its rank and "
            "-reference.",
            "none",
            targets(
                (by("", "train/capture/rank"), "rank"),
                (by("", "train/capture/step"), "step"),
                (by(", file", "train/capture/file"), "{{file}}"),
            ),
            decimals=0,
        ),
        timeseries(
            "Captures per interval, by reason",
            "Verdicts that triggered a capture (straggler, nonfinite, hang, request; past "
            "max_captures they are counted, not captured) and captures that failed (failed: an "
            "unwritable dump_dir, a name already taken, a profiler already running, a full disk).",
            "short",
            targets((increase_by(", reason", "train/capture/count"), "{{run}} {{reason}}")),
        ),
    ]
