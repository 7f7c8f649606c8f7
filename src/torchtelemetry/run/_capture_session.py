"""One capture on one rank: its directory, its stacks at the start, a profile of the next steps, and
(on a thread of its own) the trace, the allocator's memory snapshot and NCCL's flight record.

The training thread makes the directory (`os.mkdir`, mode 0700: a name already taken, a symlink
included, fails), writes every thread's Python stacks to `stacks.txt` and starts `torch.profiler`
(CPU, and CUDA on a GPU; shapes and Python stacks recorded); after `steps` steps it stops the profiler
and hands the rest to the writer thread (`torchtelemetry-capture-writer`): `trace.json` (Chrome /
Perfetto JSON, written by the profiler into a private temporary directory inside the capture's,
then linked into place: a name already taken fails, never followed), and where present
`memory.pickle` and `nccl_trace.pkl`, each opened `O_CREAT | O_EXCL | O_NOFOLLOW`, 0600. Any failure
(the directory, a profiler already running, a full disk) ends the capture with one warning: never
an exception into training. The device-specific parts are two calls, guarded, on the same path.
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile

from torchtelemetry.run._dumps import (
    NCCL_FILE,
    STACKS_FILE,
    make_capture_directory,
    open_exclusive,
    write_flight_record,
    write_stacks,
)

__all__ = ["CaptureSession", "CaptureSpec", "warm_profiler"]

logger = logging.getLogger(__name__)

TRACE_FILE = "trace.json"
MEMORY_FILE = "memory.pickle"


def warm_profiler() -> None:
    """Import what the profiler's first start imports (about 3 s of `torch._inductor` on a CPU host),
    so that the training thread does not: on a thread of its own, when an order names this rank."""
    try:
        import torch._inductor.config  # noqa: F401
    except Exception as error:  # an install without inductor: the profiler starts without it
        logger.info("Telemetry: torch._inductor could not be imported ahead of a capture: %s", error)


def _record(step: int) -> ProfilerAction:
    """The profiler's schedule: every step recorded (and marked `ProfilerStep#<n>`)."""
    return ProfilerAction.RECORD


@dataclass(frozen=True, slots=True)
class CaptureSpec:
    """What one capture is and holds."""

    directory: Path
    header: str
    """The first line of `stacks.txt`: who captures what, and why."""
    steps: int
    cuda: bool
    """Profile the device too."""
    memory: bool
    """Write the allocator's memory snapshot (history recording is on)."""
    flight_recorder: bool
    """Write NCCL's flight record."""


class CaptureSession:
    """One capture (see the module): `start()`, `stepped()` per step until it returns True, `finish()`;
    then `ok` once `done` is set. The training thread drives it; it never raises."""

    def __init__(self, spec: CaptureSpec) -> None:
        self.spec = spec
        self._profiler: profile | None = None
        self._steps = 0
        self.done = threading.Event()
        self.ok = False
        """Every file it was to hold was written."""

    def start(self) -> bool:
        """Make the directory, write the stacks and start the profiler; False (`done`, one warning)
        when any of it failed."""
        spec = self.spec
        try:
            make_capture_directory(spec.directory.parent, spec.directory.name)
            write_stacks(spec.directory / STACKS_FILE, spec.header)
        except OSError as error:
            return self._failed(f"could not write {spec.directory} ({error})")
        if torch._C._autograd._profiler_enabled():
            return self._failed("a profiler is already running on this rank; it is left alone")
        try:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if spec.cuda else [])
            self._profiler = profile(
                activities=activities,
                schedule=_record,
                record_shapes=True,
                with_stack=True,
            )
            self._profiler.start()
        except Exception as error:
            self._profiler = None
            return self._failed(f"the profiler did not start ({type(error).__name__}: {error})")
        return True

    def stepped(self) -> bool:
        """A step ended; True once the capture holds its `steps` steps (or the profiler failed)."""
        self._steps += 1
        if self._steps >= self.spec.steps:
            return True
        try:
            self._profiler.step()
        except Exception as error:
            self._failed(f"the profiler failed at a step ({type(error).__name__}: {error})")
            return True
        return False

    def finish(self) -> None:
        """Stop the profiler and, unless the capture failed, write the files on the writer thread."""
        profiler, self._profiler = self._profiler, None
        try:
            profiler.stop()
        except Exception as error:
            if not self.done.is_set():
                self._failed(f"the profiler did not stop ({type(error).__name__}: {error})")
            return
        if self.done.is_set():  # it failed at a step: nothing to write
            return
        writer = threading.Thread(
            target=self._write, args=(profiler,), name="torchtelemetry-capture-writer", daemon=True
        )
        writer.start()

    def wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the files; False if they are still being written."""
        return self.done.wait(timeout_s)

    def _write(self, profiler: profile) -> None:
        directory = self.spec.directory
        try:
            self._write_trace(profiler)
            if self.spec.memory:
                snapshot = torch.cuda.memory._snapshot()
                with os.fdopen(open_exclusive(directory / MEMORY_FILE), "wb") as file:
                    pickle.dump(snapshot, file)
            if self.spec.flight_recorder:
                write_flight_record(directory / NCCL_FILE)
        except Exception as error:
            self._failed(f"could not write it ({type(error).__name__}: {error})")
            return
        self.ok = True
        self.done.set()

    def _write_trace(self, profiler: profile) -> None:
        """The profiler writes its own file (by name, through a temporary it renames): into a
        directory of its own, made here, and the result is linked into place."""
        directory = self.spec.directory
        with tempfile.TemporaryDirectory(dir=directory, prefix=".trace-") as private:
            written = Path(private) / TRACE_FILE
            profiler.export_chrome_trace(str(written))
            if not written.is_file():  # the profiler logs a failed write and returns
                raise OSError(f"the profiler wrote no trace to {written}")
            os.chmod(written, 0o600)
            os.link(written, directory / TRACE_FILE, follow_symlinks=False)

    def _failed(self, why: str) -> bool:
        logger.warning(
            'Telemetry: capture %s failed: %s; counted in train/capture/count{reason="failed"}, '
            "training goes on",
            self.spec.directory,
            why,
        )
        self.ok = False
        self.done.set()
        return False
