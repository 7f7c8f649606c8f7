"""Building a `Telemetry` is collective: every rank learns whether every rank started, within a bound."""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch.distributed as dist

__all__ = [
    "EveryRank",
    "ExportPolicy",
    "TelemetryStartupError",
    "agree_on_start",
    "export_policy",
    "require_process_group",
]


class TelemetryStartupError(RuntimeError):
    """`Telemetry` did not start on every rank: one rank failed, or not every rank built it in time."""


def require_process_group(op: str) -> None:
    """Raise when the environment launches several processes (`WORLD_SIZE` > 1) without a process group.

    Without one, every process would export its own values as the whole run's, under its own run id.
    """
    if dist.is_available() and dist.is_initialized():
        return
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return
    if world_size > 1:
        raise RuntimeError(
            f"{op}: WORLD_SIZE={world_size} in the environment (torchrun or a launcher started "
            f"{world_size} processes) but torch.distributed is not initialized, so each process would "
            "export its own values as if they were the whole run's; call "
            "torch.distributed.init_process_group() before building it"
        )


@dataclass(frozen=True, slots=True)
class ExportPolicy:
    """Who exports a `Telemetry`'s values, and under which run id."""

    exporting: bool
    """This rank starts the exporters."""
    run_id_suffix: str
    """Added to the run id: empty for the whole world, `-group<r>` for a group led by global rank r."""


def export_policy(group: dist.ProcessGroup | None, given: object, op: str = "Telemetry") -> ExportPolicy:
    """The export policy, "the group's rank 0": rank 0 of each `Telemetry`'s group exports that
    group's values, so that every group's values are exported, also where global rank 0 is not
    in it (pipeline stages, each with a `Telemetry(group=stage_group)`). A group smaller than the
    world exports its run as `<run id>-group<r>`, r the global rank of its rank 0, so several
    groups' runs are told apart. `group` is the resolved `given` (None: no process group, or this
    rank is not in `given`: then nothing would ever export its values, and this raises).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return ExportPolicy(exporting=True, run_id_suffix="")
    if group is None:
        raise ValueError(
            f"{op}: rank {dist.get_rank()} is not in group={given!r}, so nothing would ever export "
            "what it collects; build each rank's Telemetry with a group it belongs to (its pipeline "
            "stage's, its data-parallel replica's) or with group=None"
        )
    leader = dist.get_global_rank(group, 0)
    whole = dist.get_world_size(group) == dist.get_world_size()
    return ExportPolicy(exporting=dist.get_rank(group) == 0, run_id_suffix="" if whole else f"-group{leader}")


def agree_on_start(
    failure: Exception | None, *, timeout_s: float, op: str = "Telemetry", proposal: object = None
) -> EveryRank:
    """Share each rank's start-up outcome with every rank; raise on every rank if one failed.

    Collective over the default group, on a gloo group of its own created with `timeout_s`, so a
    rank that never arrives (`if rank == 0: Telemetry(...)`) makes the others raise within
    `timeout_s`, naming it (each rank counts its start-ups in the default group's store), and the
    training's own collectives are never involved. Re-raises `failure` on the
    rank where it happened (with a note naming the rank); the other ranks raise
    `TelemetryStartupError` naming each failed rank and its error. Without a process group it only
    re-raises `failure`. Returns that gloo group as an `EveryRank`, for later checks that every
    rank is at the same point, whose `agreed` is global rank 0's `proposal` (the run id every rank
    takes); the caller releases it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if failure is not None:
            raise failure
        return EveryRank(None, timeout_s, proposal)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    outcome = None if failure is None else f"{type(failure).__name__}: {failure}"
    arrivals = _Arrivals(rank)
    outcomes: list[tuple[str | None, object, int]] = [(None, None, 0)] * world_size
    try:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        try:
            dist.all_gather_object(outcomes, (outcome, proposal, arrivals.count), group=group)
        except BaseException:
            dist.destroy_process_group(group)
            raise
    except Exception as error:
        missing = arrivals.missing(world_size)
        who = f"ranks {missing} did not build it" if missing else "not every rank built it"
        raise TelemetryStartupError(
            f"{op} (rank {rank} of {world_size}): {who} within timeout_s={timeout_s:g}s "
            f"({type(error).__name__}: {error}); building it is collective: build it on every rank "
            "(only rank 0 exports), or raise timeout_s if some rank starts later"
        ) from (failure if failure is not None else error)
    failed = {index: text for index, (text, _, _) in enumerate(outcomes) if text is not None}
    if failure is not None or failed:
        dist.destroy_process_group(group)
    if failure is not None:
        failure.add_note(f"{op} failed to start on rank {rank} of {world_size}; every rank raised")
        raise failure
    if failed:
        listed = "; ".join(f"rank {index}: {text}" for index, text in failed.items())
        raise TelemetryStartupError(
            f"{op} (rank {rank} of {world_size}): could not start on every rank ({listed}); "
            "every rank stops here instead of training with part of the set-up"
        )
    _, agreed, started = outcomes[0]
    return EveryRank(group, timeout_s, agreed, f"torchtelemetry/every_rank/{started}/spent")


class _Arrivals:
    """Which ranks came to this start-up, counted in the default group's store: each rank counts its
    own start-ups under a key of its own, so a rank whose count is behind this rank's never came to
    this one (`if rank == 0: Telemetry(...)`)."""

    _KEY = "torchtelemetry/startups/rank{}"

    def __init__(self, rank: int) -> None:
        self._store = dist.distributed_c10d._get_default_store()
        self.count = self._store.add(self._KEY.format(rank), 1)
        """This rank's start-ups so far, this one included."""

    def missing(self, world_size: int) -> list[int]:
        """The ranks that have not come to this start-up (yet)."""
        return [peer for peer in range(world_size) if self._store.add(self._KEY.format(peer), 0) < self.count]


_COLLECTIVE = (
    "it is collective: call it on every rank at the same point (as "
    "torch.distributed.checkpoint.save does), not on one rank only"
)
"""How `EveryRank.require`'s errors end: what the caller should do."""


class EveryRank:
    """A gloo group of every rank with its own timeout (None without a process group): checks that
    every rank makes a collective call before anything waits on the training's own groups."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        timeout_s: float,
        agreed: object = None,
        spent_key: str = "",
    ) -> None:
        self._group = group
        self.timeout_s = timeout_s
        self.agreed = agreed
        """Global rank 0's proposal at start-up."""
        self._spent_key = spent_key
        """The default store's key that a rank whose check timed out sets (this group's own)."""

    def require(self, op: str) -> None:
        """Return once every rank has called this for `op`; raise a `RuntimeError` naming `op`
        within `timeout_s` otherwise, never a raw gloo error later.

        A gloo group whose collective timed out is spent: the rank where it timed out says so in the
        default group's store, and every later call raises at once, on every rank (a rank that was
        not part of the failed call does not wait out `timeout_s` on a peer that will not answer).
        """
        if self._group is None:
            return
        self._raise_if_spent(op)
        try:
            timeout = datetime.timedelta(seconds=self.timeout_s)
            dist.monitored_barrier(group=self._group, timeout=timeout, wait_all_ranks=True)
        except RuntimeError as error:
            self._mark_spent()
            raise RuntimeError(
                f"{op} (rank {dist.get_rank()} of {dist.get_world_size()}): not every rank called it "
                f"within timeout_s={self.timeout_s:g}s, or an earlier call did not reach every rank "
                f"({error}); {_COLLECTIVE}"
            ) from error

    def _raise_if_spent(self, op: str) -> None:
        """Raise at once if a rank marked this group spent; a store that cannot be read (its host
        rank is gone) leaves the answer to the barrier, which raises within `timeout_s`."""
        store = dist.distributed_c10d._get_default_store()
        try:
            spent_on = store.get(self._spent_key).decode() if store.check([self._spent_key]) else None
        except RuntimeError:  # DistError and its kinds: the store is unreachable
            return
        if spent_on is not None:
            raise RuntimeError(
                f"{op} (rank {dist.get_rank()} of {dist.get_world_size()}): an earlier call did not "
                f"reach every rank within timeout_s={self.timeout_s:g}s (it timed out on rank "
                f"{spent_on}), so no check that every rank calls it can pass any more; {_COLLECTIVE}"
            )

    def _mark_spent(self) -> None:
        """Name this rank in the store, unless a rank that timed out first already is (nothing when
        the store is unreachable: the error this rank raises says what happened either way)."""
        store = dist.distributed_c10d._get_default_store()
        with contextlib.suppress(RuntimeError):
            store.compare_set(self._spent_key, "", str(dist.get_rank()))

    def all_gather_object(self, value: object, op: str) -> list[object]:
        """Every rank's `value`, by global rank (`[value]` without a process group); a `RuntimeError`
        naming `op` within `timeout_s` when a rank does not take part."""
        if self._group is None:
            return [value]
        gathered: list[object] = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(gathered, value, group=self._group)
        except RuntimeError as error:
            raise RuntimeError(
                f"{op} (rank {dist.get_rank()} of {dist.get_world_size()}): not every rank took part "
                f"within timeout_s={self.timeout_s:g}s ({error})"
            ) from error
        return gathered

    def release(self) -> None:
        """Destroy the group (once; nothing to do once the process group itself is gone)."""
        group, self._group = self._group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)
