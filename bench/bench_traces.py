"""What the traces send, and what deciding them costs at 1,024 and 16,384 ranks.

    PYTHONPATH=src .venv/bin/python -m bench.bench_traces    # --ranks 4 --steps 60 --every 10

1. Four gloo ranks train a small DDP model (three phases, the data wait, `watch_gradient_sync`, rank 3
   slow in its forward) with an `OTelExporter` pushing to a real OTLP/HTTP receiver on 127.0.0.1.
   Per window: the ranks that sent spans, their spans and the bytes of their requests (the
   uncompressed protobuf body the receiver decoded; the SDK sends it as is unless compression is
   set). Those do not grow with the world: at most `trace_ranks` ranks send a window's spans.
2. The traces thread's CPU per window of a sampled rank: building the spans and sending them
   (the receiver in this process: its decoding is not counted, this thread's time is).
3. What does grow: every rank decides each window's sampled ranks from the reduced per-rank times
   (`sample_ranks`, on its publishing thread, off the training thread) and, on the exporting rank,
   derives the exemplar. Timed here on synthetic windows of 1,024 and 16,384 ranks with four timed
   phases (three and the data wait), median of 21 windows.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from typing import Any

import torch
from tests.distributed import run_ranks
from tests.receivers import OtlpHttpReceiver
from torch.nn.parallel import DistributedDataParallel

import torchtelemetry as tt
from torchtelemetry.export import RunInfo
from torchtelemetry.report import SectionLog, sample_ranks, section_kinds
from torchtelemetry.run import TracedWindow, window_spans

DELAY_S = 0.05


def _train(rank: int, world_size: int, endpoint: str, steps: int, every: int) -> None:
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    telemetry = tt.Telemetry(
        {}, [tt.OTelExporter(endpoint=endpoint)], every=every, nvml=False, hang_after_s=None
    )
    telemetry.watch_gradient_sync(model)
    for step in range(steps):
        with telemetry.data_wait():
            batch = torch.randn(32, 64)
        with telemetry.phase("forward"):
            loss = model(batch).pow(2).mean()
            if rank == world_size - 1:
                time.sleep(DELAY_S)
        with telemetry.phase("backward"):
            loss.backward()
        with telemetry.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        telemetry.step(step)
    telemetry.close()


def _sent(ranks: int, steps: int, every: int) -> None:
    with OtlpHttpReceiver() as receiver:
        run_ranks(_train, ranks, receiver.metrics_endpoint, steps, every, timeout_s=600)
        requests = receiver.received_traces
        spans = receiver.spans()
    windows: dict[int, dict[str, Any]] = collections.defaultdict(
        lambda: {"ranks": set(), "spans": 0, "bytes": 0}
    )
    for span in spans:
        window = windows[span.attributes["torchtelemetry.step"] // every]
        window["ranks"].add(span.attributes["torchtelemetry.rank"])
        window["spans"] += 1
    for position, request in enumerate(requests):
        (step,) = {s.attributes["torchtelemetry.step"] // every for s in spans if s.request == position}
        windows[step]["bytes"] += request.size
    print("| window | ranks sending | spans | bytes (protobuf, uncompressed) | per span |")
    print("|---|---|---|---|---|")
    for number, window in sorted(windows.items()):
        ranks_sent = ", ".join(str(rank) for rank in sorted(window["ranks"]))
        per_span = window["bytes"] / window["spans"]
        print(f"| {number} | {ranks_sent} | {window['spans']} | {window['bytes']:,} | {per_span:.0f} |")
    per_rank = statistics.median(w["spans"] / len(w["ranks"]) for w in windows.values())
    print(f"\nspans per sampled rank and window (median): {per_rank:.0f} ({every} steps)")


def _building(endpoint: str, steps: int) -> tuple[float, float]:
    """Median ms of thread CPU to build one window's spans of `steps` steps of five sections (the
    traces thread's `window_spans`), and to send them (`OtlpSpanSender.send`: the SDK's spans,
    its OTLP encoding and the HTTP request), over 21 windows."""
    kinds = section_kinds(("forward", "backward", "optimizer"))
    built, sent = [], []
    sender = tt.OTelExporter(endpoint=endpoint).span_sender()
    for window in range(21):
        log = SectionLog(kinds, since=0.0)
        for step in range(steps):
            for kind in (3, 0, 1, 4, 2):  # data, forward, backward, its sync wait, optimizer
                log.record(kind, step + 0.1 * kind, step + 0.1 * kind + 0.05)
            log.stepped(window * steps + step, step + 0.9)
        sealed = log.seal()
        assert sealed is not None
        traced = TracedWindow(sealed, "bench", 0, 4, 1.7e9)
        started = time.thread_time()
        spans = window_spans(traced, 0)
        middle = time.thread_time()
        assert sender.send(spans, RunInfo(run_id="bench"))
        built.append(middle - started)
        sent.append(time.thread_time() - middle)
    sender.shutdown()
    return statistics.median(built) * 1e3, statistics.median(sent) * 1e3


def _deciding(world_size: int) -> float:
    """Median ms per window of `sample_ranks` over `world_size` ranks and four phases."""
    generator = torch.Generator().manual_seed(0)

    def by_rank() -> dict[int, float]:
        values = (0.01 + 0.001 * torch.rand(world_size, generator=generator)).tolist()
        return dict(enumerate(values))

    times = {phase: by_rank() for phase in ("data", "forward", "backward", "optimizer")}
    wait = by_rank()
    steps = by_rank()
    taken = []
    for window in range(21):
        started = time.perf_counter()
        sample_ranks(times, wait, "backward", steps, world_size=world_size, window=window, limit=3)
        taken.append(time.perf_counter() - started)
    return statistics.median(taken) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _sent(args.ranks, args.steps, args.every)
    with OtlpHttpReceiver() as receiver:
        built, sent = _building(receiver.metrics_endpoint, args.every)
    print(
        f"\nthe traces thread, per window of {args.every} steps ({6 * args.every} spans): "
        f"{built:.2f} ms of CPU to build them, {sent:.2f} ms to send them"
    )
    print("\n| ranks | deciding a window's traced ranks, per rank (ms, publishing thread) |")
    print("|---|---|")
    for world_size in (4, 1024, 16384):
        print(f"| {world_size:,} | {_deciding(world_size):.2f} |")


if __name__ == "__main__":
    main()
