"""Hangs (issue 33): time from a rank stopping to the hang report in Prometheus, the heartbeat's CPU
and its store traffic.

    PYTHONPATH=src .venv/bin/python -m bench.bench_hang      # --hang-after-s 5 --healthy-s 20

Three gloo ranks (spawned processes) train a small DDP model (a step of ~50 ms) with
`Telemetry(hang_after_s=5)` and the default one-second heartbeat; a real Prometheus (scrape and
evaluation every second) scrapes rank 0's endpoint. After `--healthy-s` seconds rank 2 stops inside
`phase("forward")` (ranks 0 and 1 then wait in DDP's all-reduce). Figures:

- **detection**: wall time from rank 2 stopping to `torchtelemetry_train_hang_rank == 2` answered by
  Prometheus' query API (and to the same line on rank 0's /metrics); the floor is `hang_after_s`,
  plus up to one heartbeat interval (the stopped rank's publisher noticing), one monitor interval
  and one scrape interval;
- **CPU**: seconds on a CPU per second of wall time of each rank's `torchtelemetry-heartbeat`
  thread and of rank 0's `torchtelemetry-hang-monitor`, over the healthy part (/proc/<tid>/schedstat);
- **store traffic**: bytes of one heartbeat (key and authenticated value, as the ranks write it) and
  TCPStore's request framing; per rank per second one `set`; the exporting rank's reads per second
  are one `multi_get` of every rank's heartbeat (docs/scale.md, Hangs, for 1,024 and 16,384 ranks);
- **at scale** (`--store-only` for this part alone): on one local TCPStore holding 1,024 to 16,384
  heartbeats, the monitor's check per interval (one `multi_get` per 1,024 ranks, checking every
  value's authenticator, decoding, the rank the others wait for)
  and the server time of one interval's `set`s from every rank.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tests.distributed import free_port, started_ranks
from tests.servers import PrometheusServer, query
from torch.nn.parallel import DistributedDataParallel

import torchtelemetry as tt
from torchtelemetry.run import Reading
from torchtelemetry.run._monitor import HangMonitor, Judging
from torchtelemetry.run._store import StoreLink, encode_heartbeat, heartbeat_key

STOPPING_RANK = 2
SECRET = bytes(32)
TCPSTORE_SET_FRAMING = 1 + 8 + 8
"""TCPStore's SET request besides key and value: the query type byte and two 8-byte lengths."""


def _thread_cpu_s(name: str) -> float:
    """Seconds on a CPU of this process's thread called `name` (/proc's schedstat, in ns)."""
    (thread,) = [thread for thread in threading.enumerate() if thread.name == name]
    return int(Path(f"/proc/self/task/{thread.native_id}/schedstat").read_text().split()[0]) / 1e9


def _train(
    rank: int, world_size: int, directory: str, port: int, hang_after_s: float, healthy_s: float
) -> None:
    model = DistributedDataParallel(torch.nn.Linear(64, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_metric = tt.WeightedMeanMetric()
    telemetry = tt.Telemetry(
        {"train": {"loss": loss_metric}},
        [tt.PrometheusExporter(port=port)],
        every=10,
        run_id="bench-hang",
        hang_after_s=hang_after_s,
        dump_dir=directory,
        timeout_s=600,
    )
    started, cpu_started = time.monotonic(), _thread_cpu_s("torchtelemetry-heartbeat")
    monitor_started = _thread_cpu_s("torchtelemetry-hang-monitor") if rank == 0 else 0.0
    step = 0
    while True:
        healthy = time.monotonic() - started < healthy_s
        stop = torch.tensor([0.0 if healthy else 1.0])
        torch.distributed.all_reduce(stop)  # every rank leaves the healthy part at the same step
        if stop.item():
            break
        with telemetry.phase("forward"):
            loss = model(torch.randn(32, 64)).pow(2).mean()
            time.sleep(0.05)
        with telemetry.phase("backward"):
            loss.backward()
        with telemetry.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        loss_metric.update(loss.detach(), 32)
        telemetry.step(step)
        step += 1
    elapsed = time.monotonic() - started
    figures = {"heartbeat_cpu_per_s": (_thread_cpu_s("torchtelemetry-heartbeat") - cpu_started) / elapsed}
    if rank == 0:
        figures["monitor_cpu_per_s"] = (
            _thread_cpu_s("torchtelemetry-hang-monitor") - monitor_started
        ) / elapsed
        keys = [heartbeat_key("0123456789abcdef", r) for r in range(world_size)]  # tokens are 16 hex digits
        beats = [Reading(step, step, "optimizer", 0.05) for _ in keys]
        figures["heartbeat_bytes"] = [
            len(key) + len(encode_heartbeat(SECRET, key, beat)) for key, beat in zip(keys, beats, strict=True)
        ]
    (Path(directory) / f"figures{rank}.json").write_text(json.dumps(figures))
    with telemetry.phase("forward"):
        loss = model(torch.randn(32, 64)).pow(2).mean()
        if rank == STOPPING_RANK:
            (Path(directory) / "stopped").write_text(repr(time.time()))
            threading.Event().wait()
    with telemetry.phase("backward"):
        loss.backward()  # the all-reduce the stopped rank never joins
        threading.Event().wait()


def _store_scale(world_sizes: list[int]) -> None:
    """Per interval at `world_size` ranks, on one local TCPStore: the exporting rank's monitor (one
    `multi_get` of every heartbeat, decoding, finding the rank furthest behind) and the store taking
    every rank's `set` (from one client here: the server's cost per request, not the network's)."""
    print("| ranks | monitor check per interval (ms) | sets per interval, server time (ms) |")
    print("|---|---|---|")
    for world_size in world_sizes:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        keys = {rank: heartbeat_key("0123456789abcdef", rank) for rank in range(world_size)}
        values = [
            encode_heartbeat(SECRET, key, Reading(1234, 120000, "backward", 0.5)) for key in keys.values()
        ]
        started = time.perf_counter()
        for key, value in zip(keys.values(), values, strict=True):
            store.set(key, value)
        setting = time.perf_counter() - started
        link = StoreLink(None, name="bench-hang-store", timeout_s=60.0, store=store)
        judging = Judging(SECRET, ("forward", "backward", "optimizer"), hang_after_s=300, interval_s=1)
        monitor = HangMonitor(link, keys, judging, join_s=60.0, report=lambda values: None)
        checks = []
        for _ in range(5):
            started = time.perf_counter()
            monitor.check()
            checks.append(time.perf_counter() - started)
        link.close(60.0)
        print(f"| {world_size:,} | {min(checks) * 1e3:.1f} | {setting * 1e3:.1f} |")


def _wait(found, deadline_s: float = 300.0):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        value = found()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError("not found in time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hang-after-s", type=float, default=5.0)
    parser.add_argument("--healthy-s", type=float, default=20.0)
    parser.add_argument("--store-ranks", default="1024,4096,16384", help="world sizes for the store's cost")
    parser.add_argument("--store-only", action="store_true", help="only the store's cost at --store-ranks")
    args = parser.parse_args()
    if args.store_only:
        _store_scale([int(size) for size in args.store_ranks.split(",")])
        return
    port = free_port()
    with tempfile.TemporaryDirectory() as directory, tempfile.TemporaryDirectory() as workdir:
        prometheus = PrometheusServer(workdir)
        prometheus.scrape("trainer", [f"127.0.0.1:{port}"])  # before start: scraped from the first second
        with prometheus, started_ranks(_train, 3, directory, port, args.hang_after_s, args.healthy_s):
            stopped_file = Path(directory) / "stopped"
            _wait(stopped_file.exists)
            stopped_at = float(_wait(stopped_file.read_text))
            on_metrics = None
            while True:
                now = time.time()
                if on_metrics is None:
                    text = _http_text(f"http://127.0.0.1:{port}/metrics")
                    if 'torchtelemetry_train_hang_rank{route="scrape",run="bench-hang"} 2.0' in text:
                        on_metrics = now - stopped_at
                samples = query(prometheus.url, "torchtelemetry_train_hang_rank == 2")
                if samples:
                    in_prometheus = now - stopped_at
                    break
                if now - stopped_at > 120:
                    up = query(prometheus.url, "up")
                    raise TimeoutError(f"no hang report in Prometheus within 120 s (up: {up})")
                time.sleep(0.05)
            figures = [json.loads((Path(directory) / f"figures{rank}.json").read_text()) for rank in range(3)]
    sizes = figures[0]["heartbeat_bytes"]
    print(f"hang_after_s = {args.hang_after_s:g} s, heartbeat_interval_s = 1 s, scrape/evaluation every 1 s")
    print(f"rank stopped -> hang line on rank 0's /metrics: {on_metrics:.2f} s" if on_metrics else "")
    print(f"rank stopped -> torchtelemetry_train_hang_rank == 2 in Prometheus: {in_prometheus:.2f} s")
    for rank, figure in enumerate(figures):
        print(f"rank {rank}: heartbeat thread CPU {figure['heartbeat_cpu_per_s'] * 1e3:.3f} ms per s")
    print(f"rank 0: hang monitor thread CPU {figures[0]['monitor_cpu_per_s'] * 1e3:.3f} ms per s")
    print(
        f"one heartbeat: {max(sizes)} bytes of key and value (+{TCPSTORE_SET_FRAMING} framing per set); "
        f"per rank per second: {max(sizes) + TCPSTORE_SET_FRAMING} bytes written"
    )
    _store_scale([int(size) for size in args.store_ranks.split(",")])


def _http_text(url: str) -> str:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except OSError:
        return ""


if __name__ == "__main__":
    main()
