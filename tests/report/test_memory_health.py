"""Memory health on every rank, reduced over ranks with the rank holding the extreme as a value."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.report.windows import collect_window, context
from torchtelemetry.report.signals import MemoryHealth, SignalContext, SignalSet, resident_bytes

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
    assert window["train/memory/alloc_retries/max"] == stats["num_alloc_retries"]
    assert "train/memory/ooms/max_rank" not in window or stats["num_ooms"] > 0
