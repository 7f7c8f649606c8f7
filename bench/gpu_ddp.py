"""A real DDP training loop with every part of torchtelemetry on, checked against the loop's own values,
and what the telemetry costs that loop. Made for a GPU (NCCL); on a CPU machine it runs the same over gloo.

    PYTHONPATH=src:. torchrun --nproc-per-node 1 -m bench.gpu_ddp --out DIR

1. The check: a GPT-like model trained with DDP under bf16 autocast, with `data_wait()`, the three
   phases, the non-finite sentinel (one NaN fed to `train/aux_loss` at a known step), memory health,
   NVML and the hang heartbeat on, exporting JSONL and a scrape endpoint. Every window's loss and
   accuracy in the JSONL file, and the last window's in one `/metrics` scrape, are compared with the
   values the loop computed itself (float64 on the host, after the run); the CUDA driver's syncs
   (`torch.cuda.set_sync_debug_mode("warn")`) are counted by the file and line that caused them.
2. The cost: blocks of steps alternate between the loop with no metrics and the loop with everything
   on (same model, same data stream), `--blocks` measured blocks per variant after a warm-up pair, for
   the demo's tiny model (launch-bound: the worst case) and the GPT-like one. Per variant: steps/s,
   the training thread's CPU per step, and `Telemetry.step()`'s CPU on window steps and on other steps.

Rank 0 prints one Markdown table per part and writes `gpu_ddp.json` (and the run's JSONL) to `--out`.
Exit status: 0 every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import platform
import pstats
import statistics
import time
import urllib.request
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from prometheus_client.parser import text_string_to_metric_families
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import torchtelemetry as tt
from torchtelemetry.demo import TinyLM

NAN_STEP = 33
"""The step at which every rank feeds `train/aux_loss` a NaN (the sentinel must count one per rank)."""
EVERY = 10


@dataclass(frozen=True, slots=True)
class Shape:
    """A model and batch size: `width` 0 is the demo's TinyLM."""

    name: str
    width: int
    layers: int
    vocab: int
    seq_len: int
    batch: int


SHAPES = {
    "gpt": Shape("gpt (1024 wide, 8 layers, 8 x 1024 tokens, bf16)", 1024, 8, 32768, 1024, 8),
    "demo": Shape("demo TinyLM (64 wide, 2 layers, 16 x 32 tokens)", 0, 2, 64, 32, 16),
    "cpu": Shape("gpt, CPU size (128 wide, 2 layers, 4 x 64 tokens)", 128, 2, 512, 64, 4),
}


class GPT(nn.Module):
    """A causal pre-norm transformer."""

    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.width)
        self.position = nn.Parameter(torch.zeros(shape.seq_len, shape.width))
        layer = nn.TransformerEncoderLayer(
            shape.width, shape.width // 64, 4 * shape.width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, shape.layers, enable_nested_tensor=False)
        self.head = nn.Linear(shape.width, shape.vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(shape.seq_len))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.encoder(hidden, mask=self.mask, is_causal=True))


def _model(shape: Shape, device: torch.device) -> nn.Module:
    model = TinyLM(shape.vocab, shape.seq_len) if shape.width == 0 else GPT(shape)
    return model.to(device)


class Loop:
    """One rank's training loop; `step(telemetry)` runs one step, with telemetry when it is given."""

    def __init__(self, shape: Shape, device: torch.device, *, keep_own: bool) -> None:
        torch.manual_seed(0)
        self.shape, self.device = shape, device
        self.ddp = DistributedDataParallel(
            _model(shape, device), device_ids=[device.index] if device.type == "cuda" else None
        )
        self.optimizer = torch.optim.AdamW(self.ddp.parameters(), lr=1e-4, fused=device.type == "cuda")
        self.generator = torch.Generator().manual_seed(dist.get_rank())
        self.metrics = {
            "train": {
                "loss": tt.WeightedMeanMetric(),
                "aux_loss": tt.WeightedMeanMetric(),
                "accuracy": tt.AccuracyMetric(),
            }
        }
        for metric in self.metrics["train"].values():
            metric.to(device)
        self.tokens = shape.batch * shape.seq_len
        self.own: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if keep_own else None
        """(loss, correct predictions) of every step run with telemetry, device tensors (`keep_own`)."""

    def batch(self) -> torch.Tensor:
        tokens = torch.randint(
            0, self.shape.vocab, (self.shape.batch, self.shape.seq_len + 1), generator=self.generator
        )
        return (
            tokens.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else tokens
        )

    def step(self, step: int, telemetry: tt.Telemetry | None) -> None:
        phase = telemetry.phase if telemetry is not None else _no_phase
        data = telemetry.data_wait() if telemetry is not None else _no_phase("data")
        with data:
            batch = self.batch()
        inputs, targets = batch[:, :-1], batch[:, 1:].reshape(-1)
        with phase("forward"), torch.autocast(self.device.type, torch.bfloat16):
            logits = self.ddp(inputs).float().reshape(-1, self.shape.vocab)
            loss = nn.functional.cross_entropy(logits, targets)
        with phase("backward"):
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
        with phase("optimizer"):
            nn.utils.clip_grad_norm_(self.ddp.parameters(), 1.0, foreach=True)
            self.optimizer.step()
        if telemetry is None:
            return
        loss = loss.detach()
        metrics = self.metrics["train"]
        metrics["loss"].update(loss, self.tokens)
        metrics["aux_loss"].update(torch.full_like(loss, math.nan) if step == NAN_STEP else loss, self.tokens)
        metrics["accuracy"].update(logits.detach(), targets)
        if self.own is not None:
            self.own.append((loss.clone(), (logits.detach().argmax(-1) == targets).sum()))
        telemetry.step(step, tokens=self.tokens, samples=self.shape.batch, learning_rate=1e-4)


class _no_phase:
    """A stand-in for `Telemetry.phase` in the loop without telemetry."""

    def __init__(self, name: str) -> None:
        del name

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# -- 1. the check -------------------------------------------------------------------------------------


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels.keys() - {"run", "route"}
    }


def _close(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _value(value: Any) -> float:
    return float(value) if not isinstance(value, str) else float(value.replace("Infinity", "inf"))


def check(shape: Shape, steps: int, device: torch.device, out: str) -> list[tuple[str, str, bool]]:
    loop = Loop(shape, device, keep_own=True)
    jsonl = os.path.join(out, "gpu_ddp.jsonl")
    if dist.get_rank() == 0 and os.path.exists(jsonl):
        os.remove(jsonl)
    prometheus = tt.PrometheusExporter(port=0)
    exporters = [tt.JsonlExporter(jsonl), prometheus] if dist.get_rank() == 0 else []
    telemetry = tt.Telemetry(loop.metrics, exporters, every=EVERY, dump_dir=out, run_id="gpu-ddp")
    telemetry.watch_gradient_sync(loop.ddp)
    syncs: Counter[str] = Counter()
    try:
        for step in range(5):  # warm-up: compile kernels and allocator pools outside the sync count
            loop.step(step, None)
        _synchronize(device)
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for step in range(steps):
                    loop.step(step, telemetry)
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        syncs.update(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
        telemetry.flush()
        scraped = _scrape(prometheus.url) if dist.get_rank() == 0 else {}
    finally:
        telemetry.close()
    own = [(float(loss), int(correct)) for loss, correct in loop.own or ()]
    every_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, own)
    if dist.get_rank() != 0:
        return []
    with open(jsonl, encoding="utf-8") as file:
        reports = [json.loads(line) for line in file]
    ranks = len(every_rank)
    own_loss = [sum(rank[step][0] for rank in every_rank) / ranks for step in range(steps)]
    own_correct = [sum(rank[step][1] for rank in every_rank) / ranks for step in range(steps)]
    rows: list[tuple[str, str, bool]] = []
    windows = steps // EVERY
    by_step = {report["step"]: report["values"] for report in reports}
    loss_ok, accuracy_ok, nan_window_ok = 0, 0, True
    for window in range(windows):
        values = by_step.get((window + 1) * EVERY - 1, {})
        taken = slice(window * EVERY, (window + 1) * EVERY)
        expected_loss = sum(own_loss[taken]) / EVERY  # equal token counts: the weighted mean is the mean
        expected_accuracy = sum(own_correct[taken]) / (EVERY * loop.tokens)
        loss_ok += _close(_value(values.get("train/loss", math.nan)), expected_loss)
        accuracy_ok += _close(_value(values.get("train/accuracy", math.nan)), expected_accuracy)
        aux = _value(values.get("train/aux_loss", math.nan))
        nan_window_ok &= math.isnan(aux) == (window == NAN_STEP // EVERY)
    rows.append(("JSONL windows", f"{len(reports)} reports for {windows} windows", len(reports) >= windows))
    rows.append(("train/loss = the loop's own mean", f"{loss_ok} of {windows} windows", loss_ok == windows))
    rows.append(
        ("train/accuracy = the loop's own", f"{accuracy_ok} of {windows} windows", accuracy_ok == windows)
    )
    rows.append(("NaN in train/aux_loss only in its window", f"step {NAN_STEP}", nan_window_ok))
    last = reports[-1]["values"] if reports else {}
    nonfinite = _value(last.get("train/nonfinite/count", {}).get("train/aux_loss", math.nan))
    rows.append(("sentinel: non-finite values counted", f"{nonfinite:g} (fed {ranks})", nonfinite == ranks))
    present = sorted(name for name in last if name.startswith(("train/phase/", "train/memory/", "hw/gpu/")))
    wanted = ["train/phase/forward", "train/phase/backward", "train/phase/optimizer", "train/sync_wait"]
    if device.type == "cuda":
        wanted += ["train/memory/allocated/max", "hw/gpu/power/max", "hw/gpu/temperature/max"]
    missing = [name for name in wanted if name not in last]
    rows.append(
        ("phases, sync wait, memory health, NVML exported", f"missing: {missing or 'none'}", not missing)
    )
    waited, backward = (
        last.get(name, {}).get("0", math.nan) for name in ("train/sync_wait", "train/phase/backward")
    )
    rows.append(
        (
            "sync wait of rank 0 (alone it waits for nobody) vs its backward",
            f"{waited * 1e3:.3f} ms vs {backward * 1e3:.3f} ms",
            ranks > 1 or waited < backward / 2,
        )
    )
    rows.append(("last report's signal values", json.dumps({n: last[n] for n in present})[:1500], True))
    final_loss = sum(own_loss[(windows - 1) * EVERY : windows * EVERY]) / EVERY
    scraped_loss = next((value for name, value in scraped.items() if name.endswith("train_loss")), math.nan)
    rows.append(
        (
            "/metrics train_loss = the loop's last window",
            f"{scraped_loss!r} vs {final_loss!r}",
            _close(scraped_loss, final_loss),
        )
    )
    hang = {name: value for name, value in last.items() if name.startswith("train/hang/")}
    rows.append(("no hang reported", f"{hang or 'none'}", not hang))
    ours = {where: count for where, count in syncs.items() if "torchtelemetry" in where}
    rows.append(
        (
            "CUDA driver syncs caused by torchtelemetry",
            f"{sum(ours.values())} {dict(ours)}; all: {dict(syncs)}",
            not ours,
        )
    )
    health = {name: (h.exported_reports, h.errors) for name, h in telemetry.hub.health().items()}
    rows.append(
        ("exporters (reports, errors)", f"{health}", all(errors == 0 for _, errors in health.values()))
    )
    return rows


# -- 2. the cost --------------------------------------------------------------------------------------


def cost(shape: Shape, blocks: int, steps_per_block: int, device: torch.device) -> dict[str, Any]:
    loop = Loop(shape, device, keep_own=False)
    telemetry = tt.Telemetry(loop.metrics, [], every=EVERY, run_id="gpu-ddp-cost")
    window_cpu: list[float] = []
    other_cpu: list[float] = []
    original_step = telemetry.step

    def timed_step(step: int, **inputs: Any) -> None:
        started = time.thread_time()
        original_step(step, **inputs)
        (window_cpu if step % EVERY == EVERY - 1 else other_cpu).append(time.thread_time() - started)

    telemetry.step = timed_step  # type: ignore[method-assign]
    rates: dict[str, list[float]] = {"bare": [], "telemetry": []}
    cpu: dict[str, list[float]] = {"bare": [], "telemetry": []}
    step = 0
    try:
        for block in range(2 * blocks + 2):  # the first pair warms up
            variant = "telemetry" if block % 2 else "bare"
            _synchronize(device)
            dist.barrier()
            started, started_cpu = time.perf_counter(), time.thread_time()
            for _ in range(steps_per_block):
                loop.step(step, telemetry if variant == "telemetry" else None)
                step += 1
            _synchronize(device)
            if block >= 2:
                rates[variant].append(steps_per_block / (time.perf_counter() - started))
                cpu[variant].append((time.thread_time() - started_cpu) / steps_per_block)
            if block == 1:
                window_cpu.clear()
                other_cpu.clear()
    finally:
        telemetry.close()
    bare, full = statistics.median(rates["bare"]), statistics.median(rates["telemetry"])
    return {
        "shape": shape.name,
        "steps_per_s": {variant: [round(r, 2) for r in values] for variant, values in rates.items()},
        "overhead_pct": 100 * (1 - full / bare),
        "thread_cpu_us_per_step": {v: statistics.median(values) * 1e6 for v, values in cpu.items()},
        "step_cpu_us": {
            "window": statistics.median(window_cpu) * 1e6,
            "other": statistics.median(other_cpu) * 1e6,
        },
    }


def profile(shape: Shape, steps: int, device: torch.device) -> str:
    """A cProfile of `steps` steps of the loop with telemetry, after a warm-up: torchtelemetry's
    functions by cumulative time, then every function by own time."""
    loop = Loop(shape, device, keep_own=False)
    telemetry = tt.Telemetry(loop.metrics, [], every=EVERY, run_id="gpu-ddp-profile")
    profiler = cProfile.Profile()
    try:
        for step in range(2 * EVERY):
            loop.step(step, telemetry)
        profiler.enable()
        for step in range(2 * EVERY, 2 * EVERY + steps):
            loop.step(step, telemetry)
        profiler.disable()
    finally:
        telemetry.close()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats("torchtelemetry", 40)
    stats.sort_stats("tottime").print_stats(25)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--steps", type=int, default=60, help="steps of the check (a multiple of 10)")
    parser.add_argument("--blocks", type=int, default=3, help="measured blocks per variant")
    parser.add_argument("--steps-per-block", type=int, default=40)
    parser.add_argument("--profile", type=int, default=0, help="steps of the demo model to cProfile")
    parser.add_argument("--shapes", default=None, help="comma-separated shapes for the cost (gpt,demo,cpu)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    os.makedirs(args.out, exist_ok=True)
    try:
        rows = check(SHAPES["gpt" if cuda else "cpu"], args.steps, device, args.out)
        shapes = (args.shapes or ("gpt,demo" if cuda else "cpu")).split(",")
        costs = [cost(SHAPES[name], args.blocks, args.steps_per_block, device) for name in shapes]
        profiled = profile(SHAPES["demo"], args.profile, device) if args.profile else ""
    finally:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", 0)) != 0:
        return
    where = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    world = os.environ.get("WORLD_SIZE")
    print(f"\n{where}, torch {torch.__version__}, CUDA {torch.version.cuda}, world {world}")
    print("| check | figure | verdict |\n|---|---|---|")
    for check_name, figure, passed in rows:
        print(f"| {check_name} | {figure} | {'pass' if passed else 'FAIL'} |")
    print(
        "\n| model | no metrics steps/s | telemetry steps/s | overhead | training-thread CPU per step,"
        " none / telemetry | step() CPU, window / other steps |\n|---|---|---|---|---|---|"
    )
    for c in costs:
        print(
            f"| {c['shape']} | {statistics.median(c['steps_per_s']['bare']):.1f} "
            f"({', '.join(map(str, c['steps_per_s']['bare']))}) | "
            f"{statistics.median(c['steps_per_s']['telemetry']):.1f} "
            f"({', '.join(map(str, c['steps_per_s']['telemetry']))}) | {c['overhead_pct']:+.2f} % | "
            f"{c['thread_cpu_us_per_step']['bare']:.0f} / "
            f"{c['thread_cpu_us_per_step']['telemetry']:.0f} µs | "
            f"{c['step_cpu_us']['window']:.0f} / {c['step_cpu_us']['other']:.0f} µs |"
        )
    print(profiled)
    with open(os.path.join(args.out, "gpu_ddp.json"), "w", encoding="utf-8") as file:
        json.dump(
            {"device": where, "torch": torch.__version__, "checks": rows, "costs": costs}, file, indent=1
        )
    raise SystemExit(0 if all(passed for _, _, passed in rows) else 1)


if __name__ == "__main__":
    main()
