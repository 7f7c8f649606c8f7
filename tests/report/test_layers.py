"""`Telemetry.watch_layers` on real gloo ranks: every exported layer norm is the full tensor's norm
(from an all-gathered copy) under DDP, FSDP2, HSDP and a DTensor `Shard` / `Replicate` mix, a
replicated parameter is counted once; a NaN's layer, pass, step and rank; and the window's
collectives are the same with and without it."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import torchtelemetry as tt
from tests.distributed import RankFailed, run_ranks

NAN = float("nan")
WINDOW = 2
STEPS = 4
LAYERS = {"ddp": ("0", "1", "3"), "dtensor": ("0", "2", "3")}
"""The modules that hold parameters: Linear, LayerNorm, Linear for `_model()`; Linear, Linear,
LayerNorm for the tensor parallel one."""


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


def _telemetry() -> tt.Telemetry:
    return tt.Telemetry(
        {"train": {"loss": tt.WeightedMeanMetric()}}, every=WINDOW, hang_after_s=None, capture_on=()
    )


def _train(model: nn.Module, telemetry: tt.Telemetry, steps: int, before_backward=None) -> None:
    """`steps` SGD steps of `model` on this rank's random batches; `before_backward(step)` may return
    a hook handle, removed after that step's backward."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        handle = before_backward(step) if before_backward is not None else None
        model(torch.randn(8, 6)).pow(2).mean().backward()
        if handle is not None:
            handle.remove()
        optimizer.step()
        optimizer.zero_grad()
        telemetry.step(step)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor: a DTensor gathered, or a plain one checked to be the same on every rank (one
    copy, as DDP keeps it)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.full_tensor().double()
    copies = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, tensor.detach().contiguous())
    assert all(torch.equal(copy, copies[0]) for copy in copies), "a replicated parameter differs over ranks"
    return copies[0].double()


def _reference(model: nn.Module, layers: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Each layer's gradient and parameter norm from the full tensors, before the optimizer step."""
    norms: dict[str, dict[str, float]] = {"grad_norm": {}, "param_norm": {}}
    for layer in layers:
        parameters = list(model.get_submodule(layer).parameters(recurse=False))
        norms["param_norm"][layer] = math.sqrt(sum(_full(p).pow(2).sum().item() for p in parameters))
        norms["grad_norm"][layer] = math.sqrt(sum(_full(p.grad).pow(2).sum().item() for p in parameters))
    return norms


def _wrapped(kind: str, rank: int, world_size: int) -> tuple[nn.Module, nn.Module]:
    """The model wrapped for `kind`, and the module whose paths name its layers."""
    from torch.distributed.device_mesh import init_device_mesh

    model = _model()
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model), model
    if kind in ("fsdp", "hsdp"):
        from torch.distributed.fsdp import fully_shard

        shape, names = (
            ((world_size,), ("shard",)) if kind == "fsdp" else ((world_size, 1), ("replicate", "shard"))
        )
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for layer in ("0", "3"):
            fully_shard(model.get_submodule(layer), mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,))
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4), nn.LayerNorm(4))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})  # Shard(0), Shard(1)
    distribute_module(  # a LayerNorm whose parameters are Replicate() over the mesh
        model[3],
        mesh,
        input_fn=lambda module, inputs, mesh: tuple(
            DTensor.from_local(x, mesh, [Replicate()]) for x in inputs
        ),
        output_fn=lambda module, output, mesh: output.to_local(),
    )
    return model, model


def _exactness(rank: int, world_size: int, kind: str) -> list[tuple[dict, dict]]:
    model, named = _wrapped(kind, rank, world_size)
    telemetry = _telemetry()
    telemetry.watch_layers(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 if kind == "dtensor" else rank + 1)  # tensor parallel ranks take the same batch
    compared = []
    for step in range(STEPS):
        loss = model(torch.randn(8, 6)).pow(2).mean()
        loss.backward()
        reference = _reference(named, LAYERS.get(kind, LAYERS["ddp"])) if (step + 1) % WINDOW == 0 else None
        optimizer.step()
        optimizer.zero_grad()
        telemetry.step(step)
        if reference is not None:
            telemetry.flush()
            latest = telemetry.latest
            exported = {stat: latest.get(f"train/layer/{stat}") for stat in ("grad_norm", "param_norm")}
            compared.append((exported, reference))
    telemetry.close()
    return compared


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["ddp", "fsdp", "hsdp", "dtensor"])
def test_every_layer_norm_is_the_full_tensors_norm_and_a_replica_counts_once(kind: str) -> None:
    results = run_ranks(_exactness, 2, kind, timeout_s=150)
    for compared in results:
        assert len(compared) == STEPS // WINDOW
        for exported, reference in compared:
            for stat in ("grad_norm", "param_norm"):
                assert exported[stat] is not None and set(exported[stat]) == set(reference[stat]), stat
                for layer, norm in reference[stat].items():
                    assert exported[stat][layer] == pytest.approx(norm, rel=1e-6), (stat, layer)


def _nan_born(rank: int, world_size: int, where: str) -> dict:
    model = _model()
    poisoned = {"on": False}
    if where == "forward":  # registered first: the watch's own check sees the NaN this hook makes
        model[1].register_forward_hook(lambda module, args, output: output * NAN if poisoned["on"] else None)
    ddp = nn.parallel.DistributedDataParallel(model)
    telemetry = _telemetry()
    telemetry.watch_layers(ddp)

    def poison(step: int):
        poisoned["on"] = where == "forward" and step == 2 and rank == 1
        if where == "backward" and step == 4 and rank == 1:
            return model[3].weight.register_hook(lambda grad: grad * NAN)
        return None

    torch.manual_seed(rank)
    _train(ddp, telemetry, 6, poison)
    telemetry.close()
    return {name: value for name, value in telemetry.latest.items() if "first_nonfinite" in name}


@pytest.mark.timeout(180)
def test_a_nan_written_into_a_gradient_is_named_by_layer_backward_step_and_rank() -> None:
    born = run_ranks(_nan_born, 2, "backward", timeout_s=150)[0]
    # Rank 1's own gradient of layer 3's weight at step 4 (DDP's all-reduce then spreads it to both
    # ranks' parameters, so at step 5 layer 3's output is NaN on every rank: rank 0 first).
    assert born["train/layer/first_nonfinite/backward"] == {"3": 4.0}
    assert born["train/layer/first_nonfinite_rank/backward"] == {"3": 1.0}
    assert born["train/layer/first_nonfinite/forward"] == {"3": 5.0}
    assert born["train/layer/first_nonfinite_rank/forward"] == {"3": 0.0}


@pytest.mark.timeout(180)
def test_a_nan_produced_in_a_forward_output_is_named_by_its_layer_and_forward() -> None:
    born = run_ranks(_nan_born, 2, "forward", timeout_s=150)[0]
    # Layer 1's output on rank 1 at step 2; layer 3's output follows from it, later in the forward.
    assert born["train/layer/first_nonfinite/forward"] == {"1": 2.0}
    assert born["train/layer/first_nonfinite_rank/forward"] == {"1": 1.0}


class _NanGradient(torch.autograd.Function):
    """The identity, whose backward makes the gradient NaN."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, gradient):
        return gradient * NAN


def _nan_born_under_fsdp(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    poisoned = {"on": False}
    model[3].register_forward_hook(
        lambda module, args, output: _NanGradient.apply(output) if poisoned["on"] else None
    )
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in ("0", "3"):
        fully_shard(model.get_submodule(layer), mesh=mesh)
    fully_shard(model, mesh=mesh)
    telemetry = _telemetry()
    telemetry.watch_layers(model)  # the gradients checked are the unsharded ones FSDP swaps in
    torch.manual_seed(rank)
    _train(model, telemetry, 4, lambda step: poisoned.update(on=step == 2 and rank == 1))
    telemetry.close()
    return {name: value for name, value in telemetry.latest.items() if "first_nonfinite" in name}


@pytest.mark.timeout(180)
def test_under_fsdp2_a_nan_in_a_gradient_is_named_by_the_rank_whose_own_gradient_had_it() -> None:
    born = run_ranks(_nan_born_under_fsdp, 2, timeout_s=150)[0]
    # Rank 1's gradient of layer 3's output turned NaN at step 2: its own unsharded gradients, before
    # the reduce-scatter gave a NaN shard to every rank; layer 3 is the first the backward reaches.
    assert born["train/layer/first_nonfinite/backward"] == {"3": 2.0}
    assert born["train/layer/first_nonfinite_rank/backward"] == {"3": 1.0}


def _watch_while_a_window_is_in_flight(rank: int, world_size: int) -> dict:
    model = nn.parallel.DistributedDataParallel(_model())
    telemetry = _telemetry()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2 * WINDOW):
        if step == WINDOW - 1 and rank == 1:
            time.sleep(1.0)  # rank 0 schedules the first window, then watches, while it waits for rank 1
        model(torch.randn(8, 6)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        telemetry.step(step)
        if step == WINDOW - 1:
            telemetry.watch_layers(model)
    telemetry.close()
    return {name: value for name, value in telemetry.latest.items() if name.startswith("train/layer/")}


@pytest.mark.timeout(180)
def test_watching_while_a_window_is_in_flight_collects_that_window_first() -> None:
    for latest in run_ranks(_watch_while_a_window_is_in_flight, 2, timeout_s=150):
        assert set(latest["train/layer/grad_norm"]) == set(LAYERS["ddp"])


COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce_scatter_tensor",
    "barrier",
    "monitored_barrier",
)


def _collectives(rank: int, world_size: int, watch: bool) -> tuple[int, int]:
    """Collectives issued in Python by this rank (the training's DDP all-reduce is its C++ reducer's):
    over the first window, and over the 3 windows after it."""
    counted = [0]
    lock = threading.Lock()

    def counting(real):
        def collective(*args, **kwargs):
            with lock:
                counted[0] += 1
            return real(*args, **kwargs)

        return collective

    for name in COLLECTIVES:
        setattr(dist, name, counting(getattr(dist, name)))
    model = nn.parallel.DistributedDataParallel(_model())
    telemetry = _telemetry()
    if watch:
        telemetry.watch_layers(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    windows = []
    for step in range(4 * WINDOW):
        model(torch.randn(8, 6)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        telemetry.step(step)
        if (step + 1) % WINDOW == 0:
            telemetry.flush()
            with lock:
                windows.append(counted[0])
    telemetry.close()
    return windows[0], windows[-1] - windows[0]


@pytest.mark.timeout(180)
def test_the_windows_collectives_are_the_same_with_and_without_watching_layers() -> None:
    without = run_ranks(_collectives, 2, False, timeout_s=150)
    watched = run_ranks(_collectives, 2, True, timeout_s=150)
    for (first_without, steady_without), (first_watched, steady_watched) in zip(
        without, watched, strict=True
    ):
        assert steady_watched == steady_without > 0
        # The one-off check that every rank holds the new layout (as bind() checks the first one).
        assert first_watched == first_without + 1


def _different_layers(rank: int, world_size: int) -> None:
    model = nn.parallel.DistributedDataParallel(_model())
    telemetry = _telemetry()
    telemetry.watch_layers(model, layers=["0", "1"] if rank == 0 else ["0", "3"])
    try:
        _train(model, telemetry, WINDOW)
    finally:
        telemetry.close()


@pytest.mark.timeout(180)
def test_ranks_watching_other_layers_raise_naming_the_layers_at_the_next_window() -> None:
    with pytest.raises(RankFailed) as failed:
        run_ranks(_different_layers, 2, timeout_s=150)
    for rank in (0, 1):
        assert "LayoutMismatchError" in failed.value.errors[rank]
        assert (
            "'train/layer/window' has layers=['0', '1'] on rank 0 but layers=['0', '3'] on rank 1"
            in (failed.value.errors[rank])
        )
