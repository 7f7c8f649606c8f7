"""A rank's evidence on disk: its Python stacks, NCCL's flight record and capture directories,
written where no one can redirect them or lose them.

Each file is opened `O_CREAT | O_EXCL | O_NOFOLLOW` with mode 0600: a name already taken (a planted
symlink, a file of another attempt of the run) is never followed or overwritten. A capture directory
(`torchtelemetry-capture-<run>-rank<r>-step<s>-<reason>`) is made with `os.mkdir(mode=0o700)`, which
fails on any name already taken, a symlink included. A hung rank's stacks go to a capture directory
of their own while `HangCaptures` allows, else (and whenever that directory cannot be made) to a
stack file, `...-step<s>-<n>.txt` with `n` the first number free; a rank writes at most `MAX_DUMPS`
stack files per `Telemetry`. The report names the file written.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CAPTURE_PREFIX",
    "DUMP_DIR_ENV",
    "MAX_DUMPS",
    "DumpFiles",
    "HangCaptures",
    "capture_name",
    "dump_directory",
    "flight_recorder_on",
    "make_capture_directory",
    "open_exclusive",
    "write_flight_record",
    "write_stacks",
]

logger = logging.getLogger(__name__)

MAX_DUMPS = 16
"""Stack files one rank writes per `Telemetry` at most (a flight record rides with its stack file)."""
DUMP_DIR_ENV = "TORCHTELEMETRY_DUMP_DIR"
"""The environment variable naming `dump_dir` where the configuration gives none (a job spec's)."""
CAPTURE_PREFIX = "torchtelemetry-capture-"
"""How the name of every capture directory begins."""
STACKS_FILE = "stacks.txt"
NCCL_FILE = "nccl_trace.pkl"
_TRIES = 64
"""Names tried for one file before giving up (each taken by something else)."""


def open_exclusive(path: Path) -> int:
    """A new file at `path`, for writing, mode 0600; `FileExistsError` when anything is there (a
    symlink included, which is never followed)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(path, flags, 0o600)


def dump_directory(dump_dir: str | os.PathLike[str] | None) -> Path:
    """`TelemetryConfig.dump_dir`, else `$TORCHTELEMETRY_DUMP_DIR`, else the current directory."""
    if dump_dir is not None:
        return Path(dump_dir)
    return Path(os.environ.get(DUMP_DIR_ENV) or Path.cwd())


def flight_recorder_on(backend: str | None) -> bool:
    """NCCL's flight recorder is on (`TORCH_NCCL_TRACE_BUFFER_SIZE` > 0): dump it with the stacks."""
    size = os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE", "0") or "0"
    return backend == "nccl" and size.isdigit() and int(size) > 0


def _safe_run(run_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)


def capture_name(run_id: str, rank: int, step: int, reason: str, *, reference: bool = False) -> str:
    """The directory name of `rank`'s capture for `reason` starting at `step` (a reference rank's
    ends in `-reference`)."""
    name = f"{CAPTURE_PREFIX}{_safe_run(run_id)}-rank{rank}-step{step}-{reason}"
    return name + "-reference" if reference else name


def make_capture_directory(parent: Path, name: str) -> Path:
    """`parent / name`, new, mode 0700 (`parent` made if missing); `OSError` when the name is taken
    (a symlink included, never followed) or the directory cannot be made."""
    parent.mkdir(parents=True, exist_ok=True)
    path = parent / name
    os.mkdir(path, 0o700)
    return path


def write_stacks(path: Path, header: str) -> None:
    """A new file at `path` holding `header` and this process's Python stacks (every thread)."""
    with os.fdopen(open_exclusive(path), "w") as file:
        file.write(header + "\n\n")
        file.flush()
        faulthandler.dump_traceback(file, all_threads=True)


def write_flight_record(path: Path) -> bool:
    """NCCL's flight record in a new file at `path`; False (logged) when it could not be dumped."""
    try:  # torch's flight recorder (private API): untestable without NCCL, so guarded and logged
        from torch._C._distributed_c10d import _dump_nccl_trace

        record = _dump_nccl_trace()
        with os.fdopen(open_exclusive(path), "wb") as file:
            file.write(record)
    except Exception as error:
        logger.warning("Telemetry: could not dump NCCL's flight recorder to %s: %s", path, error)
        return False
    return True


@dataclass(slots=True)
class HangCaptures:
    """A rank's hang captures: up to `limit` capture directories its stacks go to when it hangs."""

    limit: int
    written: int = 0
    failed: int = 0
    """Capture directories that could not be made (the stacks went to a stack file instead)."""


class DumpFiles:
    """One rank's stack files in `directory` (created if missing), and its hang captures there."""

    def __init__(
        self,
        directory: Path,
        rank: int,
        *,
        flight_recorder: bool,
        limit: int = MAX_DUMPS,
        captures: HangCaptures | None = None,
    ) -> None:
        self.directory = directory
        self._rank = rank
        self._flight_recorder = flight_recorder
        self._limit = limit
        self._captures = captures
        self.written = 0
        """Stack files written so far."""

    def write(self, run_id: str, step: int, header: str, *, about: int | None = None) -> str:
        """Write `header` and this process's Python stacks (every thread) to a new file named with
        the run, the rank (`about`, default this one), the step and a number, or (this rank's own,
        while `HangCaptures` allows) to a hang capture's `stacks.txt`; returns its path, or why none
        was written (`(not written: ...)`)."""
        captures = self._captures
        if about is None and captures is not None and captures.written < captures.limit:
            captured = self._write_capture(captures, run_id, step, header)
            if captured is not None:
                return captured
        if self.written >= self._limit:
            return f"(not written: this rank wrote its limit of {self._limit} stack files)"
        self.directory.mkdir(parents=True, exist_ok=True)
        rank = self._rank if about is None else about
        seen_by = "" if about is None else f"-seen-by-rank{self._rank}"
        for number in range(1, _TRIES + 1):
            stem = (
                self.directory
                / f"torchtelemetry-hang-{_safe_run(run_id)}-rank{rank}-step{step}{seen_by}-{number}"
            )
            try:
                write_stacks(stem.with_name(f"{stem.name}.txt"), header)
            except FileExistsError:
                continue
            self.written += 1
            if self._flight_recorder:
                write_flight_record(stem.with_name(f"{stem.name}-flight-recorder.pkl"))
            return str(stem.with_name(f"{stem.name}.txt"))
        return f"(not written: {_TRIES} names in {self.directory} were taken)"

    def _write_capture(self, captures: HangCaptures, run_id: str, step: int, header: str) -> str | None:
        """The stacks in a new hang capture directory; None (logged, counted failed) when it cannot
        be made or written."""
        name = capture_name(run_id, self._rank, step, "hang")
        try:
            directory = make_capture_directory(self.directory, name)
            write_stacks(directory / STACKS_FILE, header)
        except OSError as error:
            captures.failed += 1
            logger.warning(
                "Telemetry: rank %d could not write its hang capture %s (%s); its stacks go to a stack "
                "file instead, training goes on",
                self._rank,
                self.directory / name,
                error,
            )
            return None
        captures.written += 1
        if self._flight_recorder:
            write_flight_record(directory / NCCL_FILE)
        return str(directory / STACKS_FILE)
