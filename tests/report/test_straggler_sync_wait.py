"""Measuring the wait for the gradient collective changes nothing of the training: gradients bit for
bit the same with and without `watch_gradient_sync`, on a DDP over a subgroup, with the user's own
communication hook registered before or after, under `no_sync()` accumulation and under FSDP2; no
communication hook of its own, and every hook it registers gone at `close()`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel

import torchtelemetry as tt
from tests.distributed import run_ranks

STEPS = 4


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batch(rank: int, step: int, micro: int = 0) -> torch.Tensor:
    """Each rank's own data: the ranks' gradients differ, so averaging over the wrong ranks shows."""
    return torch.full((2, 8), float(rank + 1)) + step + micro / 10


def _gradients(model: torch.nn.Module) -> list[bytes]:
    """This rank's gradients (its shards under FSDP2), bit for bit."""
    grads = [p.grad for p in model.parameters()]
    assert all(grad is not None for grad in grads)
    return [(g.to_local() if hasattr(g, "to_local") else g).numpy().tobytes() for g in grads]


def _train(
    rank: int,
    model: torch.nn.Module,
    *,
    micro_batches: int = 1,
    slow: int | None = None,
    step: Callable[[int], None] = lambda _: None,
) -> list[list[bytes]]:
    """`STEPS` steps of SGD; each step's gradients. Under `micro_batches` > 1 the first ones
    accumulate under DDP's `no_sync()`; rank `slow` sleeps before each step's last backward."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step = []
    for index in range(STEPS):
        for micro in range(micro_batches):
            last = micro == micro_batches - 1
            if last and rank == slow:
                time.sleep(0.2)  # the others wait for it in the all-reduce
            context = model.no_sync() if not last else _nothing()
            with context:
                model(_batch(rank, index, micro)).pow(2).mean().backward()
        per_step.append(_gradients(model))
        optimizer.step()
        optimizer.zero_grad()
        step(index)
    return per_step


class _nothing:
    """No context: the last micro-batch's backward synchronizes."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _counting(calls: list[int]) -> Callable[[Any, Any], torch.futures.Future]:
    """The user's fp16 compression hook, counting its calls."""

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP compares a hook's annotations
        calls.append(1)
        return fp16_compress_hook(state, bucket)

    return hook


def _ddp(rank: int, world_size: int, groups: list[list[int]], user_hook: str) -> dict[str, Any]:
    """Train a DDP over this rank's data-parallel group of `groups` (every rank creates every group)
    without telemetry, then the same with it (`user_hook`: "", "before" or "after" watching)."""
    made = [dist.new_group(ranks) for ranks in groups]
    group = next(g for g, ranks in zip(made, groups, strict=True) if rank in ranks)

    def ddp() -> DistributedDataParallel:
        return DistributedDataParallel(_module(), process_group=group)

    plain_calls: list[int] = []
    plain = ddp()
    if user_hook:
        plain.register_comm_hook(group, _counting(plain_calls))
    expected = _train(rank, plain)

    telemetry = tt.Telemetry({}, [], every=2, nvml=False)
    model = ddp()
    calls: list[int] = []
    if user_hook == "before":
        model.register_comm_hook(group, _counting(calls))
    hooks_before = len(model._forward_hooks)
    telemetry.watch_gradient_sync(model)
    if user_hook == "after":
        model.register_comm_hook(group, _counting(calls))
    got = _train(rank, model, step=telemetry.step)
    telemetry.close()
    return {
        "expected": expected,
        "got": got,
        "calls": (len(plain_calls), len(calls)),
        "hooks_left": len(model._forward_hooks) - hooks_before,
        "wait": telemetry.latest.get("train/sync_wait"),
    }


def _assert_bit_identical(expected: list[list[bytes]], got: list[list[bytes]]) -> None:
    assert len(expected) == len(got) == STEPS
    for step, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert want == have, f"step {step}: the gradients differ"


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("world_size", "groups"),
    [(2, [[0], [1]]), (4, [[0, 1], [2, 3]])],
    ids=["2 ranks, a DP group of 1 each", "4 ranks, two DP groups of 2"],
)
def test_a_subgroup_ddp_trains_bit_identically_with_its_wait_measured(
    world_size: int, groups: list[list[int]]
) -> None:
    results = run_ranks(_ddp, world_size, groups, "", timeout_s=150)
    for result in results:
        _assert_bit_identical(result["expected"], result["got"])
        assert result["hooks_left"] == 0  # close() removed its forward hook
        assert set(result["wait"]) == {str(r) for r in range(world_size)}
    # The groups' gradients really differ: an all-reduce over the world would have shown.
    assert results[0]["expected"][0] != results[-1]["expected"][0]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("registered", ["before", "after"])
def test_the_users_own_comm_hook_keeps_working_registered_before_or_after(registered: str) -> None:
    results = run_ranks(_ddp, 2, [[0, 1]], registered, timeout_s=150)
    for result in results:
        _assert_bit_identical(result["expected"], result["got"])
        plain_calls, calls = result["calls"]
        assert calls == plain_calls > 0  # the user's hook ran on every bucket, as without telemetry


def _accumulated(rank: int, world_size: int) -> dict[str, Any]:
    """Three micro-batches a step, the first two under `no_sync()`; rank 1 sleeps 0.2 s before its
    step's synchronized backward, so rank 0 waits there."""
    expected = _train(rank, DistributedDataParallel(_module()), micro_batches=3)
    telemetry = tt.Telemetry({}, [], every=STEPS, nvml=False)
    model = DistributedDataParallel(_module())
    telemetry.watch_gradient_sync(model)
    got = _train(rank, model, micro_batches=3, slow=1, step=telemetry.step)
    telemetry.close()
    return {"expected": expected, "got": got, "wait": telemetry.latest["train/sync_wait"]}


@pytest.mark.timeout(180)
def test_no_sync_accumulation_trains_bit_identically_and_the_rank_that_waits_shows_it() -> None:
    results = run_ranks(_accumulated, 2, timeout_s=150)
    for result in results:
        _assert_bit_identical(result["expected"], result["got"])
    wait = results[0]["wait"]
    # Rank 0 waits about 0.2 s a step for rank 1 (ten times the step's own work); rank 1 for nobody.
    assert wait["0"] > wait["1"] >= 0, wait


def _fsdp2(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))

    def sharded() -> torch.nn.Module:
        module = _module()
        for layer in module:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(module, mesh=mesh)

    expected = _train(rank, sharded())
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("torchtelemetry").addHandler(handler)
    telemetry = tt.Telemetry({}, [], every=2, nvml=False)
    model = sharded()
    telemetry.watch_gradient_sync(model)
    got = _train(rank, model, slow=1, step=telemetry.step)
    telemetry.close()
    return {
        "expected": expected,
        "got": got,
        "wait": telemetry.latest["train/sync_wait"],
        "warnings": warnings,
    }


@pytest.mark.timeout(180)
def test_fsdp2_trains_bit_identically_and_says_which_wait_it_measures() -> None:
    """`fully_shard` on a CPU mesh over gloo. Its all-gathers and (on CPU, synchronous)
    reduce-scatters wait inside the backward, before the last gradient: the tail measured after it
    is what is left, and a warning says so."""
    results = run_ranks(_fsdp2, 2, timeout_s=150)
    for result in results:
        _assert_bit_identical(result["expected"], result["got"])
        assert any("fully_shard (FSDP2)" in warning for warning in result["warnings"])
    wait = results[0]["wait"]
    assert set(wait) == {"0", "1"} and all(seconds >= 0 for seconds in wait.values()), wait
