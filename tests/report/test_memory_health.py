"""Memory health on every rank, reduced over ranks with the rank holding the extreme as a value."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import torch

from tests.distributed import run_ranks
from tests.report.windows import collect_window, context
from torchtelemetry.report._memory import AllocatorStats
from torchtelemetry.report.signals import (
    MemoryHealth,
    PeakMemory,
    SignalContext,
    SignalSet,
    builtin_descriptors,
    resident_bytes,
)

BALLAST = 256 << 20


def _one_rank_holds_more(rank: int, world_size: int, heavy: int) -> tuple[dict, int]:
    ballast = torch.ones(BALLAST // 4) if rank == heavy else None  # written: resident, not just mapped
    signals = SignalSet([MemoryHealth(context(world_size, rank))])
    window = collect_window(signals)
    del ballast
    return window, resident_bytes()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("heavy", [0, 2])
def test_the_rank_with_the_largest_resident_set_is_named_with_its_size(heavy: int) -> None:
    results = run_ranks(_one_rank_holds_more, 3, heavy)
    window = results[0][0]
    assert window["train/memory/rss/max_rank"] == float(heavy)
    assert window["train/memory/rss/max"] >= BALLAST
    assert set(window) == {"train/memory/rss/max", "train/memory/rss/max_rank"}  # CPU: no CUDA detail


def test_resident_bytes_follow_what_the_process_touches() -> None:
    before = resident_bytes()
    ballast = torch.ones(BALLAST // 4)
    assert resident_bytes() - before >= BALLAST * 0.9
    del ballast


def _read_in_forks(depth: int, write: int) -> None:
    """Fork a child that reads its resident set three times, writes its number of open file
    descriptors to `write` and does the same from there, `depth` forks deep in all."""
    pid = os.fork()
    if pid == 0:
        try:
            for _ in range(3):
                resident_bytes()
            os.write(write, b"%d\n" % len(os.listdir("/proc/self/fd")))
            if depth > 1:
                _read_in_forks(depth - 1, write)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files in /proc/self/fd")
def test_a_fork_reads_its_own_resident_set_without_keeping_its_parents_file_open() -> None:
    resident_bytes()  # the parent's /proc/<pid>/statm is open when it forks
    read, write = os.pipe()
    _read_in_forks(3, write)
    os.close(write)
    with os.fdopen(read) as pipe:
        open_files = [int(count) for count in pipe.read().split()]
    assert len(open_files) == 3
    assert len(set(open_files)) == 1, f"open files grew by one per fork: {open_files}"


def _scripted_allocator(
    retries: list[int], calls: list[str] | None = None, *, background: bool = False
) -> AllocatorStats:
    """The allocator's counters as `torch.cuda.memory_stats_as_nested_dict` gives them, one reading
    per window (the thread of each noted in `calls`): the CUDA calls are the only part a CPU cannot
    run."""
    readings = iter(retries)

    def memory_stats(device: torch.device) -> dict[str, Any]:
        count = next(readings)
        if calls is not None:
            calls.append(threading.current_thread().name)
        allocated = {"all": {"current": 1 << 20, "peak": 3 << 20}}
        return {"num_alloc_retries": count, "num_ooms": count // 2, "allocated_bytes": allocated}

    return AllocatorStats(
        torch.device("cpu"),
        memory_stats=memory_stats,
        mem_get_info=lambda _: (1 << 30, 1 << 31),
        background=background,
    )


def test_allocator_counts_are_rebased_after_a_reset_and_exported_once() -> None:
    """`torch.cuda.reset_accumulated_memory_stats()` between windows 2 and 3 restarts the counts
    (7 -> 1): the window counts what happened since the reset, never a negative number."""
    retries = [5, 7, 1, 3]
    peak = PeakMemory(context(), allocator=_scripted_allocator(retries))
    health = MemoryHealth(context(), allocator=_scripted_allocator(retries))
    signals = SignalSet([peak, health])
    windows = [collect_window(signals, step=step, final=False) for step in range(len(retries))]
    assert [w["train/memory/alloc_retries"] for w in windows] == [5.0, 2.0, 1.0, 2.0]
    assert [w["train/memory/ooms"] for w in windows] == [2.0, 1.0, 0.0, 1.0]
    assert [w.get("train/memory/ooms/max_rank") for w in windows] == [0.0, 0.0, None, 0.0]  # once any
    # one quantity, one name: the count is the counter; the window's per-rank detail names the rank
    for window in windows:
        assert not {"train/memory/alloc_retries/max", "train/memory/ooms/max"} & set(window)
    assert windows[0]["train/memory/headroom/min"] == float(1 << 30)
    # the peak comes from the same reading (one allocator read per signal and window, bench/README.md)
    assert [w["train/peak_memory"] for w in windows] == [float(3 << 20)] * len(retries)
    names = {descriptor.name for descriptor in builtin_descriptors()}
    for quantity in ("alloc_retries", "ooms"):
        assert {name for name in names if name.startswith(f"train/memory/{quantity}")} == {
            f"train/memory/{quantity}",
            f"train/memory/{quantity}/max_rank",
        }


def test_the_memory_signals_share_one_allocator_reading_per_window() -> None:
    """`torch.cuda.memory_stats_as_nested_dict` costs the training thread about 0.3 ms on an H200
    host (bench/README.md): PeakMemory and MemoryHealth, built by `builtin_signals` with one
    `AllocatorStats`, read it once per window between them, and count each window's retries once."""
    retries, readings = [5, 7, 9], []
    allocator = _scripted_allocator(retries, readings)
    signals = SignalSet([PeakMemory(context(), allocator), MemoryHealth(context(), allocator)])
    windows = [collect_window(signals, step=step, final=False) for step in range(len(retries))]
    assert len(readings) == len(retries)
    assert [w["train/memory/alloc_retries"] for w in windows] == [5.0, 2.0, 2.0]
    assert [w["train/memory/alloc_retries/max_rank"] for w in windows] == [0.0, 0.0, 0.0]


def test_the_allocator_is_read_off_the_training_thread_and_every_count_once() -> None:
    """`builtin_signals` on CUDA reads the allocator on a thread of its own: each window takes the
    reading made after the previous one (the first, and a final one at close, read on the spot),
    and every retry is counted in exactly one window."""
    retries, threads = [5, 7, 9, 10, 11, 12, 12], []
    allocator = _scripted_allocator(retries, threads, background=True)
    signals = SignalSet([PeakMemory(context(), allocator), MemoryHealth(context(), allocator)])
    windows = []
    for step in range(4):
        windows.append(collect_window(signals, step=step, final=False))
        deadline = time.monotonic() + 30
        while len(threads) < step + 2:  # the reader thread made the next window's reading
            assert time.monotonic() < deadline, "the reader thread made no reading in 30 s"
            time.sleep(0.001)
    windows.append(collect_window(signals, step=4, final=True))  # at close: read now
    signals.close()
    here = threading.current_thread().name
    assert threads[:6] == [here, *["torchtelemetry-memory-reader"] * 4, here]
    # The reading made for a fifth window (11) is counted by the final one, which read on the spot.
    assert [w["train/memory/alloc_retries"] for w in windows] == [5.0, 2.0, 2.0, 1.0, 2.0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA allocator needs a GPU")
def test_cuda_allocator_detail_and_headroom_on_one_rank() -> None:
    device = torch.device("cuda")
    signals = SignalSet([MemoryHealth(SignalContext(world_size=1, rank=0, device=device))])
    block = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    window = collect_window(signals)
    stats = torch.cuda.memory_stats(device)
    free, _ = torch.cuda.mem_get_info(device)
    assert window["train/memory/allocated/max"] >= block.numel()
    assert window["train/memory/reserved/max"] >= window["train/memory/allocated/max"]
    assert window["train/memory/fragmentation/max"] == (
        window["train/memory/reserved/max"] - window["train/memory/allocated/max"]
    )
    assert window["train/memory/headroom/min"] == pytest.approx(free, rel=0.05)
    assert window["train/memory/headroom/min_rank"] == 0.0
    assert "train/memory/alloc_retries/max" not in window  # the count is PeakMemory's counter
    assert "train/memory/ooms/max_rank" not in window or stats["num_ooms"] > 0
