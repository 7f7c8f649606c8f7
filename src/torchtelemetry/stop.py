"""`StopOnSignal`: a training loop stops on SIGINT/SIGTERM at the same step on every rank.

An OS signal reaches the ranks at different moments (Ctrl-C reaches every process of the terminal, a
scheduler's SIGTERM may reach one), so a rank that stops on its own leaves the others waiting in
the next collective: a `CollectionError` traceback and a lost last window. Here a signal only sets
a flag; every `every` steps the ranks agree on it with one all-reduce of a single number on a gloo
group of their own (no device sync, bounded by `timeout_s`), and all of them leave the loop at that
step, so `Telemetry.close()` exports the last partial window on every rank.
"""

from __future__ import annotations

import datetime
import logging
import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["StopOnSignal"]

logger = logging.getLogger(__name__)


class StopOnSignal:
    """Turns SIGINT/SIGTERM into a stop every rank of the job agrees on, at the same step.

    ```python
    telemetry = tt.Telemetry(metrics, exporters, every=10)
    with tt.StopOnSignal(every=10) as stop:  # every rank, after init_process_group
        for step, batch in enumerate(loader):
            if stop.agreed():  # every rank, every step; an all-reduce every 10th call
                break
            train_step(batch)
            telemetry.step(step)
    telemetry.close()  # every rank: the last partial window is exported
    sys.exit(stop.exit_code)  # 130 after Ctrl-C, 143 after SIGTERM, 0 otherwise
    ```

    Building it installs the handlers (on the main thread) and, with more than one rank, creates
    a gloo group of all ranks and checks that `every` and `timeout_s` are the same on every rank
    (else the ranks would agree at different calls and stop at different steps): it is collective,
    like `Telemetry`, and raises `ValueError` on every rank naming each rank's values. A second
    signal of a kind already received gives it to the handler that was there before (Ctrl-C twice
    interrupts at once). Leaving the `with` block (or `restore()`) puts the previous handlers back.

    Args:
        every: calls of `agreed()` between two agreements (a signal stops the loop at most this
            many steps later); match `Telemetry`'s `every` to stop at a window's end.
        signals: the signals that ask for a stop.
        timeout_s: how long an agreement waits for every rank before it raises.
    """

    def __init__(
        self,
        every: int = 10,
        *,
        signals: Sequence[signal.Signals] = (signal.SIGINT, signal.SIGTERM),
        timeout_s: float = 300.0,
    ) -> None:
        if every < 1:
            raise ValueError(f"StopOnSignal.every must be at least 1, got {every}")
        if not timeout_s > 0:
            raise ValueError(f"StopOnSignal.timeout_s must be positive, got {timeout_s}")
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "StopOnSignal: build it on the main thread (Python runs signal handlers there); "
                f"this is thread {threading.current_thread().name!r}"
            )
        self.every = every
        self.timeout_s = timeout_s
        self.received: int | None = None
        """The first signal this rank received, if any."""
        self.signum: int | None = None
        """The signal the ranks agreed to stop on (the highest number any rank received), once they did."""
        self._calls = 0
        self._group: Any = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # A group of its own: the agreement never interleaves with the training's collectives
            # or the metrics collector's, and runs on the host whatever the training's backend.
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
            self._check_same_on_every_rank()
        self._previous = {signum: signal.signal(signum, self._on_signal) for signum in signals}

    @property
    def exit_code(self) -> int:
        """128 + the agreed signal's number (the shell's status for a process it ended), else 0."""
        return 0 if self.signum is None else 128 + self.signum

    def agreed(self) -> bool:
        """True once the ranks agreed to stop: call it on every rank once per step, at the same steps.

        Every `every`-th call is one all-reduce over all ranks (none on a single process, where a
        signal stops at the next call). Raises `RuntimeError` when the ranks do not all take part
        within `timeout_s` (a rank died, or calls it at other steps).
        """
        if self.signum is not None:
            return True
        calls, self._calls = self._calls, self._calls + 1
        if self._group is None:
            self.signum = self.received
            return self.signum is not None
        if calls % self.every:
            return False
        flag = torch.tensor([self.received or 0], dtype=torch.int64)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        except RuntimeError as error:
            raise RuntimeError(
                f"StopOnSignal.agreed: the ranks did not agree within timeout_s={self.timeout_s} s at call "
                f"{calls} (a rank died, or calls agreed() at other steps): {error}"
            ) from error
        self.signum = int(flag.item()) or None
        if self.signum is not None:
            logger.info("StopOnSignal: every rank stops now, on signal %d", self.signum)
        return self.signum is not None

    def restore(self) -> None:
        """Put the previous signal handlers back and release the group (idempotent)."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        self._release_group()

    def __enter__(self) -> StopOnSignal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def _check_same_on_every_rank(self) -> None:
        """Raise `ValueError` (on every rank, the group released) unless every rank has this rank's
        `every` and `timeout_s`; one all-gather, bounded by this rank's `timeout_s`."""
        mine = torch.tensor([float(self.every), self.timeout_s], dtype=torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(self._group))]
        try:
            dist.all_gather(gathered, mine, group=self._group)
        except RuntimeError as error:
            self._release_group()
            raise RuntimeError(
                f"StopOnSignal: the ranks did not all build it within timeout_s={self.timeout_s} s "
                f"(a rank died, or builds it elsewhere): {error}"
            ) from error
        settings = [(int(every), timeout_s) for every, timeout_s in (row.tolist() for row in gathered)]
        if len(set(settings)) > 1:
            self._release_group()
            found = ", ".join(
                f"rank {rank}: every={every}, timeout_s={timeout_s:g}"
                for rank, (every, timeout_s) in enumerate(settings)
            )
            raise ValueError(
                f"StopOnSignal: every and timeout_s must be the same on every rank (the ranks agree at the "
                f"same calls, or stop at different steps), got {found}; pass the same values on every rank"
            )

    def _release_group(self) -> None:
        group, self._group = self._group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
            logger.warning(
                "StopOnSignal: %s received; every rank stops within %d steps, exporting the last window "
                "(send it again to stop at once)",
                signal.Signals(signum).name,
                self.every,
            )
            return
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
