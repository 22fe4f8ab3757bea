"""Why episodes were dropped, said in full and said once.

An environment that raises drops that episode only, and the run goes on
(`grpo.envs.rollout.run_episodes`). The episode keeps why (``Episode.error``): `failure_reason`
names the exception (type and message) and where in the environment's own code it raised, in
one line. A long reason (a verifiers tool server's traceback) is kept whole and leads with its
last line, where a traceback states its cause (`cause_first`).

A broken environment fails every episode the same way, thousands of times an hour: the
collector logs each distinct reason once, with a count, then a line now and then with the
episodes dropped for it since (`DroppedEpisodeLog`), and hands each batch's counts to the driver
(`BatchDrops`), which stops a run whose environment fails nearly every episode
(`grpo.orchestrator.episode_drops`).

Pure Python: no torch, Ray or vLLM.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger(__name__)

# This package's own frames are the machinery that called the environment, not where it raised.
_ENVS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# Frames of the environment's code a reason names: where it raised, and what called that.
_FRAMES_SHOWN = 2
# A reason longer than this, or of several lines, leads with its last line (see `cause_first`).
_LONG_REASON = 200
# A formatted traceback's frame: '  File "/x/env.py", line 12, in env_response' and its code.
_TRACEBACK_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)')


def exception_name(error: BaseException) -> str:
    """``KeyError`` for a built-in exception, ``module.Class`` for any other."""
    cls = type(error)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _described(error: BaseException) -> str:
    message = str(error)
    return f"{exception_name(error)}: {message}" if message else exception_name(error)


def _frame_text(filename: str, line: int | str, name: str, code: str | None) -> str:
    where = f"{filename}:{line} in {name}"
    return f"{where}: {code.strip()}" if code and code.strip() else where


def failure_reason(error: BaseException) -> str:
    """Why an episode failed: the exception and where in the environment's code it raised.

    The frames named are the innermost ones outside `grpo.envs` (the environment's code: where
    it raised, then what called that); an exception raised in `grpo.envs` itself names its
    last frame. The exception it was raised from, if any, follows. A long message is kept whole
    after the first line (`cause_first`).

    Args:
        error (BaseException): What the environment raised.

    Returns:
        str: e.g. ``KeyError: 'anwser' (at /home/me/my_env.py:31 in env_response:
        return state["anwser"])``.
    """
    frames = traceback.extract_tb(error.__traceback__)
    own = [frame for frame in frames if not frame.filename.startswith(_ENVS_DIR)]
    shown = (own or frames)[-_FRAMES_SHOWN:]
    where = ", called from ".join(
        _frame_text(f.filename, f.lineno or 0, f.name, f.line) for f in reversed(shown)
    )
    cause = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    return cause_first(
        _described(error),
        name=exception_name(error),
        where=where or None,
        then=f"raised from {_described(cause).splitlines()[0]}" if cause is not None else None,
    )


def cause_first(
    text: str, name: str | None = None, where: str | None = None, then: str | None = None
) -> str:
    """A reason kept whole, its cause first: a long or multi-line text leads with its last line.

    A traceback, or an error message that ends with one (a tool server's stderr), states its
    cause last; a summary that shows the head of the text would show everything but the cause.

    Args:
        text (str): The reason as it came (``"SandboxError: runtime died ... KeyError: 'x'"``).
        name (str | None): The exception's type, kept in front of a long text's last line.
        where (str | None): Where it raised (``"/x/env.py:12 in env_response: ..."``).
        then (str | None): More to say on the first line (the exception it came from).

    Returns:
        str: ``text`` with ``where`` and ``then`` if it is short and on one line; else its
        last line with them, then the whole text on the lines after.
    """
    text = text.strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    long = len(lines) > 1 or len(text) > _LONG_REASON
    head = text
    if long and lines:
        head = (
            lines[-1] if name is None or lines[-1].startswith(name) else f"{name}: ... {lines[-1]}"
        )
    if where:
        head = f"{head} (at {where})"
    if then:
        head = f"{head}; {then}"
    return f"{head}\n{text}" if long else head


def last_frame(traceback_text: str) -> str | None:
    """The innermost frame of a formatted traceback (a verifiers error's), named as in
    `failure_reason`; None if it has none."""
    lines = traceback_text.splitlines()
    for index in range(len(lines) - 1, -1, -1):
        match = _TRACEBACK_FRAME.match(lines[index])
        if match:
            following = lines[index + 1] if index + 1 < len(lines) else ""
            # The frame's code line is indented under it (absent when the source was not found).
            code = following if following.startswith("    ") else None
            return _frame_text(match["file"], match["line"], match["name"], code)
    return None


@dataclass(frozen=True)
class BatchDrops:
    """One generation batch's episodes and those dropped, for the driver's guard.

    Args:
        episodes (int): Episodes the batch ran.
        dropped (int): Of them, episodes dropped because the environment failed.
        reason (str | None): The most common reason among them (None when none was dropped).
        reason_count (int): Episodes dropped for ``reason``.
    """

    episodes: int
    dropped: int
    reason: str | None = None
    reason_count: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> BatchDrops:
        return cls(**value)


class DroppedEpisodeLog:
    """Counts dropped episodes by reason; logs each reason once, then its count now and then.

    The first batch that drops episodes for a reason logs it in full (a warning with that
    batch's count); later ones for the same reason are counted and reported together, one line
    per reason, at most every ``every_s`` seconds (and on `flush`): never one line per episode.
    Past ``max_reasons`` distinct reasons (an environment whose messages name each episode's
    values), new ones are counted together as `OTHER_REASONS`. Safe to call from several
    threads (a collector's training batches and its evaluation).

    Args:
        name (str): Who drops them, for the log lines (``"collector 0"``).
        every_s (float): Least seconds between two reports of the same reason's count.
        max_reasons (int): Distinct reasons logged in full.
        clock (Callable[[], float]): The time (``time.monotonic``; tests pass their own).
    """

    OTHER_REASONS = "other reasons (only the first ones are logged in full)"

    def __init__(
        self,
        name: str,
        every_s: float = 30.0,
        max_reasons: int = 10,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.every_s = every_s
        self.max_reasons = max_reasons
        self._clock = clock
        self.totals: Counter[str] = Counter()
        self._unreported: Counter[str] = Counter()
        self._reported_at = clock()
        self._lock = threading.Lock()

    def record(self, episodes: Iterable[Any], environment: str = "the environment") -> BatchDrops:
        """Count one batch's dropped episodes (``error`` set) and log as the class says.

        Args:
            episodes (Iterable): The batch's episodes (`grpo.envs.Episode`).
            environment (str): The environment's name, for the first line of each reason.

        Returns:
            BatchDrops: The batch's counts and its most common reason.
        """
        episodes = list(episodes)
        batch = Counter(e.error for e in episodes if e.error is not None)
        dropped = sum(batch.values())
        with self._lock:
            counts: Counter[str] = Counter()
            for reason, count in batch.most_common():
                seen = self.totals.keys() | counts.keys()
                if reason not in seen and len(seen) >= self.max_reasons:
                    reason = self.OTHER_REASONS
                counts[reason] += count
            for reason, count in counts.items():
                if reason not in self.totals:
                    log.warning(
                        "%s: %d of the %d episodes of a batch were dropped because %s failed "
                        "(later ones for the same reason are counted in a line every %.0f s): %s",
                        self.name,
                        count,
                        len(episodes),
                        environment,
                        self.every_s,
                        reason,
                    )
                else:
                    self._unreported[reason] += count
                self.totals[reason] += count
            if self._clock() - self._reported_at >= self.every_s:
                self._report()
        if not batch:
            return BatchDrops(len(episodes), 0)
        reason, count = batch.most_common(1)[0]
        return BatchDrops(len(episodes), dropped, reason, count)

    def flush(self) -> None:
        """Report the counts not reported yet now."""
        with self._lock:
            self._report()

    def _report(self) -> None:
        for reason, count in self._unreported.most_common():
            log.warning(
                "%s: %d more episodes dropped for the same reason (%d in all): %s",
                self.name,
                count,
                self.totals[reason],
                reason.splitlines()[0],
            )
        self._unreported.clear()
        self._reported_at = self._clock()
