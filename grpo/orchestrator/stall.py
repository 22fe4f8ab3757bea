"""The stall watch: a run with no trained step for ``orchestration.stall_timeout_s`` names the
actor that holds it up.

Progress is a trained step, nothing else: a call that comes back empty says an actor is alive,
not that the run moves. `StallWatch.diagnose` returns a `Stall` (the actor, what it is stuck
in, whether replacing it can help); the loop acts on it. Pure Python: it only decides.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# A collector whose current engine step has run this long (a decode step takes milliseconds
# to seconds) is stuck inside vLLM.
ENGINE_STEP_STUCK_S = 60.0
# Seconds a call may take at most when nothing is wrong, by kind: a queue take waits 0.5 s and
# a buffer sample 5 s before they come back empty; the others have no bound of their own.
_BOUNDED_CALL_S = {"TAKE": 0.5, "SAMPLE": 5.0}
# Seconds between two looks at who holds the run up, once it is overdue (a look asks every
# generating collector for a heartbeat); a short timeout looks three times within it.
_LOOK_EVERY_S = 10.0

log = logging.getLogger("grpo")


@dataclass(frozen=True)
class CallInFlight:
    """One call the loop waits for: its kind (``CallKind`` name), actor name and start time."""

    kind: str
    actor: str
    started: float


@dataclass(frozen=True)
class Stall:
    """Who holds the run up.

    Args:
        actor (str): Its name (``inference[0]``, ``training[0]``, ``replay_buffer``, ...).
        reason (str): What it is stuck in, for the log and the error.
        replaceable (bool): Whether replacing the actor can help (a frozen or hung actor), or
            the run must stop (every sample dropped as stale, nothing stuck).
    """

    actor: str
    reason: str
    replaceable: bool


class StallWatch:
    """Measures the time since the last trained step and names what holds the run up.

    Args:
        timeout_s (float): ``orchestration.stall_timeout_s``.
        clock (Callable[[], float]): Monotonic seconds (tests pass a fake).

    Example:
        >>> watch = StallWatch(60.0, clock=lambda: 100.0)
        >>> watch.overdue()
        False
    """

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = float(timeout_s)
        self.clock = clock
        self.last_progress = clock()
        self._dropped_stale_at_progress: float | None = None
        self._dropped_stale_at_last_look: float | None = None
        self.look_every_s = min(_LOOK_EVERY_S, self.timeout_s / 3)
        self._next_look = 0.0
        self.stalls = 0  # actors named to be replaced because they held the run up

    def progressed(self, dropped_stale: float | None = None) -> None:
        """A step was trained (or the run (re)started): the clock starts again.

        Args:
            dropped_stale (float | None): The buffer's count of trajectories dropped as stale
                so far, if known; `diagnose` compares it with the count at a stall.
        """
        self.last_progress = self.clock()
        self._dropped_stale_at_progress = dropped_stale
        self._dropped_stale_at_last_look: float | None = None

    def idle_s(self) -> float:
        """Seconds since the last trained step."""
        return self.clock() - self.last_progress

    def overdue(self) -> bool:
        """Whether no step was trained for ``timeout_s``."""
        return self.idle_s() > self.timeout_s

    def due(self) -> bool:
        """Whether to `look` now: no step trained for ``timeout_s``, and no look for
        ``look_every_s``."""
        now = self.clock()
        if not self.overdue() or now < self._next_look:
            return False
        self._next_look = now + self.look_every_s
        return True

    def look(
        self,
        calls: Sequence[CallInFlight],
        heartbeats: Mapping[str, dict[str, Any] | None],
        buffer_stats: Mapping[str, float] | None = None,
        max_policy_lag: int | None = None,
        recovering: bool = False,
    ) -> Stall | None:
        """`diagnose`, as the loop acts on it: the culprit with the whole message as its
        reason, counted in ``stalls`` and logged when it is to be replaced (the clock then
        starts again: a replacement starting up is not a stall); None, logged, when every
        actor is working. Same arguments as `diagnose`."""
        stall = self.diagnose(calls, heartbeats, buffer_stats, max_policy_lag, recovering)
        idle, timeout = self.idle_s(), f"orchestration.stall_timeout_s={self.timeout_s:g}"
        if stall is None:
            working = sorted({call.actor for call in calls} | set(heartbeats))
            log.warning(
                "no step trained for %.0f s (%s), but every actor is working (calls in "
                "flight: %s); waiting",
                *(idle, timeout, working),
            )
            return None
        message = f"no step trained for {idle:.0f} s ({timeout}): {stall.actor} {stall.reason}"
        if stall.replaceable:
            log.warning("%s; replacing it", message)
            self.stalls += 1
            self.progressed((buffer_stats or {}).get("dropped_stale"))
        return Stall(stall.actor, message, stall.replaceable)

    def diagnose(
        self,
        calls: Sequence[CallInFlight],
        heartbeats: Mapping[str, dict[str, Any] | None],
        buffer_stats: Mapping[str, float] | None = None,
        max_policy_lag: int | None = None,
        recovering: bool = False,
    ) -> Stall | None:
        """Name the actor that holds the run up, or None if every actor is working.

        In order:

        1. a collector that does not answer (``heartbeats[name]`` is None: frozen, or stuck
           outside Python), or whose current engine step has run for `ENGINE_STEP_STUCK_S`
           (or the timeout, if that is shorter);
        2. any other call in flight for the whole timeout or more, the oldest first (a
           trainer in one step, a reference actor in one scoring call, the buffer or the
           queue: a queue take comes back after 0.5 s and a sample after 5 s when nothing
           is wrong);
        3. the buffer, when it dropped trajectories as stale since the last step, and again
           since the previous look, and nothing is stuck: the collectors' samples are older
           than ``max_policy_lag`` allows by the time they reach it, and replacing an actor
           does not change that. (Old samples dropped once after a disruption, while fresh
           ones fill the buffer, are not that: they stop being dropped.)

        A collector that waits on a full rollout queue is never the culprit: it waits for the
        actors downstream.

        Args:
            calls (Sequence[CallInFlight]): The loop's calls in flight.
            heartbeats (Mapping[str, dict | None]): Per collector with a generation call in
                flight, its `SyncLLMCollector.heartbeat` (None: no answer in time).
            buffer_stats (Mapping[str, float] | None): The buffer's last stats
                (``dropped_stale``).
            max_policy_lag (int | None): ``orchestration.max_policy_lag``, for the message.
            recovering (bool): A replaced actor has not worked yet: stale drops then come
                from a replacement that has not caught up, and rule 3 waits.

        Returns:
            Stall | None: The culprit; None when every actor is alive and moving (a slow
            run, not a stalled one).
        """
        now = self.clock()
        for name, beat in sorted(heartbeats.items()):
            if beat is None:
                return Stall(name, "does not answer (frozen, or stuck outside Python)", True)
            in_step = float(beat.get("in_engine_step_s") or 0.0)
            if in_step >= min(ENGINE_STEP_STUCK_S, self.timeout_s):
                return Stall(name, f"has been in one vLLM engine step for {in_step:.0f} s", True)
        stuck = [
            call
            for call in calls
            if call.kind != "GENERATE"
            and now - call.started >= max(self.timeout_s, 2 * _BOUNDED_CALL_S.get(call.kind, 0))
        ]
        if stuck:
            call = min(stuck, key=lambda c: c.started)
            doing = {
                "TRAIN": "one training step",
                "SCORE": "one scoring call",
                "ADD": "adding one scored batch",
                "SAMPLE": "one sample call",
                "TAKE": "one take from the queue",
            }.get(call.kind, call.kind.lower())
            return Stall(call.actor, f"has been in {doing} for {now - call.started:.0f} s", True)
        dropped = (buffer_stats or {}).get("dropped_stale")
        before = self._dropped_stale_at_progress
        last_look, self._dropped_stale_at_last_look = self._dropped_stale_at_last_look, dropped
        if dropped is not None and before is not None and dropped < before:
            before = 0.0  # a replaced buffer counts from 0
        if dropped is not None and last_look is not None and dropped < last_look:
            last_look = 0.0
        still_dropping = dropped is not None and last_look is not None and dropped > last_look
        if not recovering and still_dropping and before is not None and dropped > before:
            lag = (
                f"orchestration.max_policy_lag={max_policy_lag}"
                if max_policy_lag is not None
                else "max_policy_lag"
            )
            return Stall(
                "replay_buffer",
                f"dropped {dropped - before:.0f} trajectories as stale since the last trained "
                f"step ({lag}) and never held a batch: samples are older than the lag allows "
                "by the time they arrive. Raise orchestration.max_policy_lag, sync weights "
                "more often (weight_sync.every_n_steps), or generate smaller batches "
                "(inference.batch_size)",
                False,
            )
        return None
