"""The run's identity: its id, where the id came from, and the launcher's id of the job.

A run outlives its processes: it crashes and resumes many times, and each launch is an attempt of
it, so its id (the `run` label of every series) must survive restarts, and two runs must never
share one. In order:

1. `run_id=` (`TelemetryConfig.run_id`), else `$TORCHTELEMETRY_RUN_ID`: pinned, nothing replaces it;
2. the checkpoint: `Telemetry.state_dict()` carries the id, `load_state_dict()` adopts it;
3. `progress_file`: the id of a run that did not finish there (it crashed or was killed: its
   `close()` never recorded the end), read by the exporting rank; a finished run's id is never
   lent to a fresh run started beside its file;
4. the launcher: torchrun's rendezvous id (`$TORCHELASTIC_RUN_ID`, unless "none"), else Slurm's
   (`launcher_run_id`: the job, its array task and its step; a requeued job keeps them,
   `$SLURM_RESTART_COUNT` counts its attempts);
5. else a new id.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from torchtelemetry.export import RUN_ID_ENV, RunInfo
from torchtelemetry.run._progress import ProgressRecord

__all__ = ["RunIdentity", "launcher_run_id", "resolve_run_identity"]


@dataclass(frozen=True, slots=True)
class RunIdentity:
    """A run id (without the group suffix) and where it came from (see the module)."""

    run_id: str
    source: str
    """"argument", "environment", "checkpoint", "progress_file", "launcher" or "new"."""

    @property
    def pinned(self) -> bool:
        """Given by the user (`run_id=`, `$TORCHTELEMETRY_RUN_ID`): a checkpoint does not replace it."""
        return self.source in ("argument", "environment")


def launcher_run_id(environ: Mapping[str, str] = os.environ) -> str | None:
    """The launcher's id of the job, the same in each of its attempts and different for two runs:
    torchrun's rendezvous id, else Slurm's, in Slurm's own notation: `slurm-<job>` for the batch
    script, `slurm-<array job>_<task>` for an array task, `.<step>` added inside an `srun` step (two
    `srun` runs in one allocation are two runs; a requeued job numbers its steps from 0 again). None
    outside a launcher that names its jobs."""
    rendezvous = environ.get("TORCHELASTIC_RUN_ID", "")
    if rendezvous and rendezvous != "none":
        return rendezvous
    job = environ.get("SLURM_JOB_ID", "")
    if not job:
        return None
    array_job, task = environ.get("SLURM_ARRAY_JOB_ID", ""), environ.get("SLURM_ARRAY_TASK_ID", "")
    if array_job and task:
        job = f"{array_job}_{task}"
    step = environ.get("SLURM_STEP_ID", "")
    return f"slurm-{job}.{step}" if step else f"slurm-{job}"


def resolve_run_identity(
    given: str | None,
    progress: ProgressRecord | None,
    run_id_suffix: str,
    environ: Mapping[str, str] = os.environ,
) -> RunIdentity:
    """This rank's run id before the ranks agree on global rank 0's (see the module); `progress` is
    what its group's progress file holds (None: no file, or not read on this rank), whose id carries
    `run_id_suffix`."""
    if given:
        return RunIdentity(given, "argument")
    if environ.get(RUN_ID_ENV):
        return RunIdentity(environ[RUN_ID_ENV], "environment")
    if (
        progress is not None
        and not progress.finished
        and progress.run_id.endswith(run_id_suffix)
        and progress.run_id != run_id_suffix
    ):
        return RunIdentity(progress.run_id[: len(progress.run_id) - len(run_id_suffix)], "progress_file")
    launcher = launcher_run_id(environ)
    if launcher is not None:
        return RunIdentity(launcher, "launcher")
    return RunIdentity(RunInfo.create().run_id, "new")
