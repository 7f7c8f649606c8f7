"""The progress file: the last step a run's exporting rank reported, and whether the run finished,
kept in a file beside its checkpoints.

It serves two ends: a resumed attempt counts the steps it trains again (the file's step past the
checkpoint's: goodput's recomputed steps), and a launch that finds the file of a run that did not
finish continues that run's id (`resolve_run_identity`). `close()` records the end, so a fresh run
started beside a finished run's file is a new run.

One writer per file: the exporting rank of each group writes its own file (`progress_path`: a group
smaller than the world adds its run id suffix to the name), on a thread of its own that holds at
most the newest record, so a slow or hung file system (NFS, Lustre) never delays the training or
the publishing thread. A write goes to `<name>.partial`, created with `O_EXCL | O_NOFOLLOW` (a
symlink planted there is never followed), and is renamed over the file.

Reading takes only what the library wrote: a regular file holding a JSON object with a non-empty
string `run_id`, a non-negative integer `step` and, once the run finished, `"finished": true`.
Anything else (a FIFO, another shape, garbage) is logged once and ignored.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

__all__ = ["ProgressFile", "ProgressRecord", "RunProgress", "progress_path"]

logger = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0
"""How long `close()` waits for the last write before leaving a hung file system behind."""
_MAX_BYTES = 4096
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW


class ProgressRecord(NamedTuple):
    """What a progress file holds."""

    run_id: str
    """The run exported (with its group's suffix)."""
    step: int
    """The last step reported."""
    finished: bool = False
    """The run's `close()` recorded its end: a launch beside the file is a new run."""


def progress_path(path: str | os.PathLike[str], run_id_suffix: str) -> Path:
    """The file of one group: `path` itself for the whole world, `<stem><suffix><ext>` for a group
    (`progress-group2.json`), so pipeline stages sharing a directory never write one name."""
    path = Path(path)
    return path if not run_id_suffix else path.with_name(f"{path.stem}{run_id_suffix}{path.suffix}")


class ProgressFile:
    """Reads and (from its own daemon thread, `torchtelemetry-progress`) writes one progress file.

    `opener(path, flags)` opens the `.partial` file for writing (default `os.open` with mode 0o600).
    """

    def __init__(
        self, path: str | os.PathLike[str], *, opener: Callable[[str, int], int] | None = None
    ) -> None:
        self.path = Path(path)
        self._partial = self.path.with_name(self.path.name + ".partial")
        self._opener = opener or (lambda name, flags: os.open(name, flags, 0o600))
        self._changed = threading.Condition()
        self._pending: ProgressRecord | None = None
        self._writing = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._warned = False

    def read(self) -> ProgressRecord | None:
        """The record in the file, or None (missing; anything the library did not write: logged once)."""
        try:
            descriptor = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as error:
            return self._ignored(f"cannot be opened ({error})")
        try:
            if not stat.S_ISREG(os.fstat(descriptor).st_mode):
                return self._ignored("is not a regular file")
            with os.fdopen(descriptor, "rb", closefd=False) as file:
                content = file.read(_MAX_BYTES + 1)
        except OSError as error:
            return self._ignored(f"cannot be read ({error})")
        finally:
            os.close(descriptor)
        return self._parse(content)

    def _parse(self, content: bytes) -> ProgressRecord | None:
        if len(content) > _MAX_BYTES:
            return self._ignored(f"is larger than {_MAX_BYTES} bytes")
        try:
            progress = json.loads(content)
        except ValueError as error:
            return self._ignored(f"is not JSON ({error})")
        if not isinstance(progress, dict):
            return self._ignored(f"holds {type(progress).__name__}, not an object")
        run_id, step, finished = progress.get("run_id"), progress.get("step"), progress.get("finished", False)
        if not isinstance(run_id, str) or not run_id:
            return self._ignored(f"has no run id (run_id={run_id!r})")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            return self._ignored(f"has no step (step={step!r}, expected an integer >= 0)")
        if not isinstance(finished, bool):
            return self._ignored(f"has no finished state (finished={finished!r}, expected true or false)")
        return ProgressRecord(run_id, step, finished)

    def _ignored(self, problem: str) -> None:
        if not self._warned:
            self._warned = True
            logger.warning(
                "Telemetry: progress_file %s %s; ignored (it is written by the exporting rank: give "
                "each run its own progress_file)",
                self.path,
                problem,
            )
        return None

    def write(self, record: ProgressRecord) -> None:
        """Hand `record` to the writer thread and return at once; a newer record replaces one not
        yet written."""
        with self._changed:
            if self._closed:
                return
            self._pending = record
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="torchtelemetry-progress", daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._pending is not None or self._closed)
                record, self._pending = self._pending, None
                if record is None:
                    return
                self._writing = True
            try:
                self._write(record)
            finally:
                with self._changed:
                    self._writing = False
                    self._changed.notify_all()

    def _write(self, record: ProgressRecord) -> None:
        content = json.dumps(record._asdict()).encode()
        try:
            descriptor = self._create_partial()
            try:
                os.write(descriptor, content)
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
            os.replace(self._partial, self.path)
        except OSError as error:
            if not self._warned:
                self._warned = True
                logger.warning("Telemetry: cannot write progress_file %s: %s", self.path, error)

    def _create_partial(self) -> int:
        try:
            return self._opener(str(self._partial), _CREATE_FLAGS)
        except FileExistsError:
            # Left by a writer that died mid-write (one writer per file), or planted: the link
            # itself is removed, never followed.
            self._partial.unlink(missing_ok=True)
            return self._opener(str(self._partial), _CREATE_FLAGS)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Let the writer finish the last record (at most `timeout_s`), then stop it."""
        with self._changed:
            done = self._changed.wait_for(lambda: self._pending is None and not self._writing, timeout_s)
            self._closed = True
            self._changed.notify_all()
        if not done:
            logger.warning(
                "Telemetry: progress_file %s: the last write did not finish within %.0f s (a hung "
                "file system?); left behind",
                self.path,
                timeout_s,
            )


class RunProgress:
    """One run's progress file as the run uses it: the exporting rank (`writes`) records each step
    reported under the run's current id, and the end at `close()`; every rank reads the step the
    file holds for this run (recomputed steps after a restart)."""

    def __init__(self, file: ProgressFile, run_id: str, *, writes: bool) -> None:
        self.file = file
        self._run_id = run_id
        self._writes = writes
        self._last_step: int | None = None
        self._lock = threading.Lock()

    def adopt_run(self, run_id: str) -> None:
        """The run is (from now on) `run_id`: later records are written under it."""
        with self._lock:
            self._run_id = run_id

    def reported(self, step: int) -> None:
        """A report of step `step` was handed to the exporters (from any thread; never waits)."""
        if not self._writes:
            return
        with self._lock:
            self._last_step = step
            record = ProgressRecord(self._run_id, step)
        self.file.write(record)

    def reached_step(self) -> int | None:
        """The last step the file holds for this run, if it holds this run's (logged once if not)."""
        record = self.file.read()
        if record is None:
            return None
        with self._lock:
            run_id = self._run_id
        if record.run_id != run_id:
            logger.warning(
                "Telemetry: progress_file %s belongs to run %r, not %r; recomputed steps not counted",
                self.file.path,
                record.run_id,
                run_id,
            )
            return None
        return record.step

    def close(self, *, finished: bool) -> None:
        """Record the end (`finished`: the run ended here, rather than stopping after a failure) and
        stop the writer."""
        with self._lock:
            last = None if self._last_step is None else ProgressRecord(self._run_id, self._last_step, True)
        if finished and last is not None:
            self.file.write(last)
        self.file.close()
