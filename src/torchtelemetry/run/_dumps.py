"""Stack files: a stuck rank's Python stacks (and NCCL's flight record), written where no one can
redirect them or lose them.

Each file is opened `O_CREAT | O_EXCL | O_NOFOLLOW` with mode 0600: a name already taken (a planted
symlink, a file of another attempt of the run) is never followed or overwritten, the next number is
taken instead. Each hang gets files of its own (`...-step<s>-<n>.txt`, n the first number free),
and a rank writes at most `MAX_DUMPS` of them per `Telemetry`; the report names the file written.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import re
from pathlib import Path

__all__ = ["MAX_DUMPS", "DumpFiles", "open_exclusive"]

logger = logging.getLogger(__name__)

MAX_DUMPS = 16
"""Stack files one rank writes per `Telemetry` at most (a flight record rides with its stack file)."""
_TRIES = 64
"""Names tried for one file before giving up (each taken by something else)."""


def open_exclusive(path: Path) -> int:
    """A new file at `path`, for writing, mode 0600; `FileExistsError` when anything is there (a
    symlink included, which is never followed)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(path, flags, 0o600)


class DumpFiles:
    """One rank's stack files in `directory` (created if missing)."""

    def __init__(self, directory: Path, rank: int, *, flight_recorder: bool, limit: int = MAX_DUMPS) -> None:
        self.directory = directory
        self._rank = rank
        self._flight_recorder = flight_recorder
        self._limit = limit
        self.written = 0
        """Files written so far."""

    def write(self, run_id: str, step: int, header: str, *, about: int | None = None) -> str:
        """Write `header` and this process's Python stacks (every thread) to a new file named with
        the run, the rank (`about`, default this one), the step and a number; returns its path, or
        why none was written (`(not written: ...)`)."""
        if self.written >= self._limit:
            return f"(not written: this rank wrote its limit of {self._limit} stack files)"
        self.directory.mkdir(parents=True, exist_ok=True)
        run = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)
        rank = self._rank if about is None else about
        seen_by = "" if about is None else f"-seen-by-rank{self._rank}"
        for number in range(1, _TRIES + 1):
            stem = self.directory / f"torchtelemetry-hang-{run}-rank{rank}-step{step}{seen_by}-{number}"
            try:
                descriptor = open_exclusive(stem.with_name(f"{stem.name}.txt"))
            except FileExistsError:
                continue
            with os.fdopen(descriptor, "w") as file:
                file.write(header + "\n\n")
                file.flush()
                faulthandler.dump_traceback(file, all_threads=True)
            self.written += 1
            if self._flight_recorder:
                self._write_flight_record(stem.with_name(f"{stem.name}-flight-recorder.pkl"))
            return str(stem.with_name(f"{stem.name}.txt"))
        return f"(not written: {_TRIES} names in {self.directory} were taken)"

    @staticmethod
    def _write_flight_record(path: Path) -> None:
        try:  # torch's flight recorder (private API): untestable without NCCL, so guarded and logged
            from torch._C._distributed_c10d import _dump_nccl_trace

            record = _dump_nccl_trace()
            with os.fdopen(open_exclusive(path), "wb") as file:
                file.write(record)
        except Exception as error:
            logger.warning("Telemetry: could not dump NCCL's flight recorder to %s: %s", path, error)
