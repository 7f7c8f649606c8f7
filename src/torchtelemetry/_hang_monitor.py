"""The exporting rank's hang monitor: reads every rank's heartbeat and exports a hang report on its own.

A daemon thread (`torchtelemetry-hang-monitor`) reads all heartbeats from the heartbeat store every
interval, one `multi_get` per 1,024 ranks. A rank whose heartbeat did not change for `hang_after_s`
is lost (its process died or froze whole); a rank that made no progress for `hang_after_s` is stuck.
Once any rank is, it submits `train/hang/*` through the exporter hub every interval, whatever the
training thread is doing (blocked in a collective, most likely), and once every rank moves again it
submits one report that clears the hang. Reports carry the step of the latest window report, so the
step series of the run does not move.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from torchtelemetry.report import RankBeat, ReportValues, find_hang, hang_values

__all__ = ["KEYS_PER_READ", "HangMonitor", "decode_heartbeat", "encode_heartbeat", "heartbeat_key"]

logger = logging.getLogger(__name__)


KEYS_PER_READ = 1024
"""Heartbeats read by one `multi_get`: TCPStore's grows faster than linearly with its keys (16,384
keys take ~40x the time of 1,024 keys, 16 times over), so wider worlds are read in chunks."""


def heartbeat_key(rank: int) -> str:
    """The store key of `rank`'s heartbeat."""
    return f"torchtelemetry/heartbeat/{rank}"


def encode_heartbeat(count: int, step: int, phase: str, stalled_s: float, dump: str) -> str:
    """One heartbeat as stored: `count|step|phase|stalled_s|dump` (phases are path segments, without
    `|`; the file name comes last, whole)."""
    return f"{count}|{step}|{phase}|{stalled_s:.3f}|{dump}"


def decode_heartbeat(payload: bytes) -> tuple[str, int, str, float, str]:
    """`encode_heartbeat`'s fields back: (count as read, step, phase, stalled seconds, file)."""
    count, step, phase, stalled_s, dump = payload.decode().split("|", 4)
    return count, int(step), phase, float(stalled_s), dump


class HangMonitor:
    """Watches the heartbeats of `world_size` ranks in `store`; `submit(step, values)` exports.

    `latest_step()` is the step of the latest window report (None before the first).
    """

    def __init__(
        self,
        store: Any,
        world_size: int,
        *,
        phases: Sequence[str],
        hang_after_s: float,
        interval_s: float,
        submit: Callable[[int, ReportValues], None],
        latest_step: Callable[[], int | None],
    ) -> None:
        self._store = store
        self._keys = [heartbeat_key(rank) for rank in range(world_size)]
        self._phases = tuple(phases)
        self._hang_after_s = hang_after_s
        self._interval_s = interval_s
        self._submit = submit
        self._latest_step = latest_step
        started = time.monotonic()
        self._counts: list[str | None] = [None] * world_size
        self._heard: list[float] = [started] * world_size
        self._logged: tuple[int, int, str] | None = None
        self._failed = False
        self.hanging = False
        """Whether the last read found a hang (and a report said so)."""
        self.reads = 0
        """Reads of every heartbeat so far."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchtelemetry-hang-monitor", daemon=True)

    def start(self) -> HangMonitor:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.check()
            except Exception as error:  # a monitor that stopped reading must say so, once
                if not self._failed:
                    self._failed = True
                    logger.error("Telemetry: the hang monitor could not read the heartbeats: %s", error)

    def beats(self) -> list[RankBeat]:
        """Every rank's heartbeat, read now: one `multi_get` per `KEYS_PER_READ` ranks."""
        raw = [
            payload
            for first in range(0, len(self._keys), KEYS_PER_READ)
            for payload in self._store.multi_get(self._keys[first : first + KEYS_PER_READ])
        ]
        now = time.monotonic()
        beats = []
        for rank, payload in enumerate(raw):
            if payload:
                count, step, phase, stalled_s, dump = decode_heartbeat(payload)
            else:  # never published since the monitor started
                count, step, phase, stalled_s, dump = "", 0, "none", 0.0, ""
            if count != self._counts[rank]:
                self._counts[rank], self._heard[rank] = count, now
            silent_s = now - self._heard[rank]
            lost = silent_s >= self._hang_after_s
            beats.append(RankBeat(rank, step, phase, stalled_s + silent_s, lost=lost, dump=dump))
        self.reads += 1
        return beats

    def check(self) -> None:
        """Read every heartbeat; submit a hang report while a rank is stuck, and one to clear it."""
        beats = self.beats()
        hang = find_hang(beats, self._phases, self._hang_after_s)
        if hang is None and not self.hanging:
            return
        step = self._latest_step()
        self._submit(0 if step is None else step, hang_values(hang, sum(beat.lost for beat in beats)))
        if hang is None:
            self.hanging, self._logged = False, None
            logger.warning("Telemetry: every rank makes progress again; the hang report is cleared")
            return
        self.hanging = True
        behind = hang.behind
        if self._logged != (behind.rank, behind.step, behind.phase):
            self._logged = (behind.rank, behind.step, behind.phase)
            stuck = [beat.rank for beat in beats if beat.stalled_s >= self._hang_after_s]
            lost = [beat.rank for beat in beats if beat.lost]
            dumps = [beat.dump for beat in beats if beat.dump]
            logger.error(
                "Telemetry: hang: rank %d made no progress for %.0f s, at step %d in phase %r; "
                "stuck ranks %s, lost ranks %s; stack files so far: %s",
                behind.rank,
                behind.stalled_s,
                behind.step,
                behind.phase,
                stuck,
                lost,
                dumps or "none yet",
            )

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop reading (bounded)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
