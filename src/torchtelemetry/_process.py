"""Which process an object belongs to: threads, sockets and process groups do not survive a fork."""

from __future__ import annotations

import os

__all__ = ["check_same_process", "current_pid"]

# Process-global: the id of this process, by nature one per process (set again in a fork).
_PID = os.getpid()


def _after_fork_in_child() -> None:
    global _PID
    _PID = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def current_pid() -> int:
    """This process's id (kept current across forks without a system call)."""
    return _PID


def check_same_process(owner_pid: int, op: str) -> None:
    """Raise if the object that `op` belongs to was built in another process (this one is a fork)."""
    if owner_pid != _PID:
        raise RuntimeError(
            f"{op}: called in process {_PID}, a fork of process {owner_pid} that built it; its threads, "
            "sockets and process group stay with the parent. Build a new one in the child, or keep "
            "telemetry out of forked workers (e.g. DataLoader workers)"
        )
