"""Soak: many update steps with every exporter on; resident memory and thread count must stay flat.

    .venv/bin/python -m bench.soak                  # --steps 100000 --every 10 --sample-every 1000

One process (no process group), `Telemetry` over a weighted mean, an accuracy, a histogram and a
counter, plus the built-in signals, collecting every `--every` steps and exporting to all
backends against local peers: the Prometheus endpoint scraped once a second by a real
Prometheus, a real Pushgateway, a real OTLP/HTTP receiver (in its own process, so what it keeps
is not counted here), W&B offline and JSONL. Every `--sample-every` steps it reads VmRSS and
Threads from /proc/self/status (Threads counts every OS thread: torch's pools, gRPC, W&B's
client) and the `torchtelemetry-*` Python threads. It prints one line per sample and a summary:
start, end, max and the least-squares slope over the second half of the run (after warm-up).
Figures go to bench/README.md ("Soak"); this is not a pass/fail test.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tests.distributed import free_port
from tests.servers import PrometheusServer, PushgatewayServer, http_get

import torchtelemetry as tt

_RECEIVER = """
import sys, time
from tests.receivers import OtlpHttpReceiver
receiver = OtlpHttpReceiver(int(sys.argv[1]))
receiver.start()
print("ready", flush=True)
while True:
    time.sleep(60)
"""


@dataclass(frozen=True, slots=True)
class Sample:
    step: int
    elapsed_s: float
    rss_mib: float
    os_threads: int
    telemetry_threads: int


def _status(field: str) -> str:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return line.split()[1]
    raise KeyError(field)


def sample(step: int, started: float) -> Sample:
    return Sample(
        step=step,
        elapsed_s=time.perf_counter() - started,
        rss_mib=int(_status("VmRSS")) / 1024,  # kB
        os_threads=int(_status("Threads")),
        telemetry_threads=sum(t.name.startswith("torchtelemetry-") for t in threading.enumerate()),
    )


def slope_per_10k(samples: list[Sample], attr: str) -> float:
    """Least-squares slope of `attr` per 10,000 steps over `samples`."""
    xs = [s.step for s in samples]
    ys = [getattr(s, attr) for s in samples]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    if not var:
        return 0.0
    return 10_000 * sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--sample-every", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(prefix="torchtelemetry-soak-") as workdir:
        work = Path(workdir)
        receiver_port = free_port()
        receiver = subprocess.Popen(
            [sys.executable, "-c", _RECEIVER, str(receiver_port)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        assert receiver.stdout is not None and receiver.stdout.readline().strip() == "ready"
        prometheus = PrometheusServer(work / "prometheus")
        try:
            with PushgatewayServer(work / "pushgateway") as gateway:
                run(args, work, gateway, prometheus, receiver_port)
        finally:
            prometheus.stop()
            receiver.kill()
            receiver.wait()


def run(
    args: argparse.Namespace,
    work: Path,
    gateway: PushgatewayServer,
    prometheus: PrometheusServer,
    otlp_port: int,
) -> None:
    metrics = {
        "train": {
            "loss": tt.WeightedMeanMetric(),
            "accuracy": tt.AccuracyMetric(),
            "grad_norm": tt.HistogramMetric([0.1, 0.5, 1, 2, 5, 10]),
            "sequences": tt.SumMetric(kind="counter"),
        }
    }
    endpoint = tt.PrometheusExporter(port=0)
    exporters = [
        endpoint,
        tt.PushgatewayExporter(gateway.url),
        tt.OTelExporter(endpoint=f"http://127.0.0.1:{otlp_port}/v1/metrics", protocol="http/protobuf"),
        tt.WandbExporter(project="soak", mode="offline", dir=work / "wandb"),
        tt.JsonlExporter(work / "metrics.jsonl"),
    ]
    telemetry = tt.Telemetry(metrics, exporters, every=args.every, run_id="soak")
    prometheus.scrape("soak", [f"127.0.0.1:{endpoint.port}"])
    prometheus.start()

    train = metrics["train"]
    gen = torch.Generator().manual_seed(0)
    losses = torch.rand(1024, generator=gen)
    logits = torch.randn(1024, 8, 10, generator=gen)
    targets = torch.randint(0, 10, (1024, 8), generator=gen)
    tokens = torch.tensor(512)
    samples: list[Sample] = []
    started = time.perf_counter()
    for step in range(args.steps):
        i = step % 1024
        train["loss"].update(losses[i], tokens)
        train["accuracy"].update(logits[i], targets[i])
        train["grad_norm"].update(losses[i] * 4)
        train["sequences"].update(8)
        telemetry.step(step, tokens=tokens, samples=8, learning_rate=1e-3)
        if step % args.sample_every == 0 or step == args.steps - 1:
            samples.append(sample(step, started))
            s = samples[-1]
            print(
                f"step {s.step:>7}  {s.elapsed_s:8.1f} s  rss {s.rss_mib:7.1f} MiB  "
                f"os threads {s.os_threads:3}  torchtelemetry threads {s.telemetry_threads}",
                flush=True,
            )
    loop_s = time.perf_counter() - started
    scraped = http_get(f"{prometheus.url}/api/v1/query?query=torchtelemetry_train_step")
    telemetry.close()
    report(args, samples, loop_s, telemetry, scraped)


def report(
    args: argparse.Namespace, samples: list[Sample], loop_s: float, telemetry: tt.Telemetry, scraped: bytes
) -> None:
    late = samples[len(samples) // 2 :]
    print(
        f"\n{args.steps} steps, collection every {args.every}: {loop_s:.1f} s "
        f"({1e6 * loop_s / args.steps:.0f} µs/step)"
    )
    for attr, unit in (("rss_mib", "MiB"), ("os_threads", ""), ("telemetry_threads", "")):
        values = [getattr(s, attr) for s in samples]
        print(
            f"{attr:18} start {values[0]:8.1f}  end {values[-1]:8.1f}  max {max(values):8.1f}  "
            f"slope (2nd half) {slope_per_10k(late, attr):+.2f} {unit}/10k steps"
        )
    for name, health in telemetry.hub.health().items():
        print(
            f"exporter {name:12} exported {health.exported_reports}  errors {health.errors}  "
            f"dropped {health.dropped_reports}"
        )
    print(f"Prometheus query torchtelemetry_train_step: {scraped.decode()[:200]}")


if __name__ == "__main__":
    main()
