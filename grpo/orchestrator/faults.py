"""The fault policy: what the run does about an actor that died or raised, as a value.

A failed call is one of three things, and `FaultPolicy.decide` says which:

- `Replace`: a collector, reference actor, replay buffer or rollout queue died; a new one
  starts at its place, catches up, and the call is redone.
- `Restart`: a trainer died, and the policy and optimizer state with it; every actor starts
  again from the latest checkpoint and the steps after it are redone.
- `Stop`: the run cannot go on (an actor raised, its constructor failed, or it used up
  ``orchestration.max_actor_restarts``); the message names the actor and the root cause in
  one line.

The loop carries decisions out; this module only decides and keeps the restart counts. It
imports no Ray, so the policy is tested with a table of failures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from grpo.errors import ActorFailedError, TrainingDivergedError, describe


@dataclass(frozen=True)
class Failure:
    """A call that failed: whose, and how.

    Args:
        actor (str): The actor's name (``inference[0]``, ``replay_buffer``, ``training[1]``).
        error (BaseException): What the call raised (Ray's error, as caught).
        died (bool): The actor died (``RayActorError``); False: it raised (``RayTaskError``).
        init_failed (bool): It died because its constructor raised.
        current (bool): The failed actor is still the current one (False: an earlier failure
            of the same actor replaced it already).
    """

    actor: str
    error: BaseException
    died: bool = True
    init_failed: bool = False
    current: bool = True


@dataclass(frozen=True)
class Replace:
    """Start a new actor in place of ``actor``, catch it up, and redo its call.

    ``last`` is set when the actor used up its restarts: the run replaces it once more, so that
    the pipeline is whole for a checkpoint, then stops with ``last`` after the current step.
    """

    actor: str
    error: BaseException
    last: ActorFailedError | None = None


@dataclass(frozen=True)
class Restart:
    """Restart every actor but the metric logger from the latest checkpoint: the step ends
    (`TrainerDiedError` with ``reason``), and the loop asks `FaultPolicy.restart` whether the
    trainers' restart budget allows it."""

    reason: str


@dataclass(frozen=True)
class Stop:
    """Stop the run with ``error``, whose message names the actor and the root cause."""

    error: ActorFailedError


Decision = Replace | Restart | Stop


class FaultPolicy:
    """Decides what a failed call means for the run, and counts restarts per actor.

    Args:
        max_restarts (int): ``orchestration.max_actor_restarts``: replacements of one actor
            (restarts of the trainers, for them) before the run stops.
        output_hint (Callable[[str], str]): Where an actor's output is, for messages
            (`ActorSupervisor.output_hint`).
        resume_hint (Callable[[], str]): The checkpoint to resume from, for messages.

    Example:
        >>> policy = FaultPolicy(1, lambda name: "", lambda: "the start")
        >>> policy.decide(Failure("ref[0]", RuntimeError("gone")))
        Replace(actor='ref[0]', error=RuntimeError('gone'), last=None)
    """

    def __init__(
        self,
        max_restarts: int,
        output_hint: Callable[[str], str],
        resume_hint: Callable[[], str],
    ) -> None:
        self.max_restarts = max_restarts
        self.output_hint = output_hint
        self.resume_hint = resume_hint
        self.restarts: dict[str, int] = {}  # per actor name, and "training" for the group
        self.last: ActorFailedError | None = None  # an actor past its budget, replaced once more

    def decide(self, failure: Failure) -> Decision:
        """What to do about ``failure``; a `Replace` counts against the actor's budget."""
        name, error = failure.actor, failure.error
        hint = self.output_hint(name)
        if not failure.died:
            return Stop(ActorFailedError(f"{name} failed{hint}: {describe(error)}"))
        if failure.init_failed:
            # Its constructor raised: each replacement would raise the same way (and add the
            # same traceback to the actor's log file). Ray keeps only the text of the cause.
            return Stop(ActorFailedError(f"{name} failed to start{hint}: {error}"))
        if name.startswith("training["):
            return Restart(f"{name} died ({describe(error)}){hint}")
        if not failure.current:
            return Replace(name, error)  # replaced already: the call is redone on the new one
        restarts = self.restarts[name] = self.restarts.get(name, 0) + 1
        if restarts > self.max_restarts:
            if self.last is not None:
                return Stop(self.last)  # it died again while the run stops: nothing to save
            self.last = ActorFailedError(
                f"{name} died {restarts} times (orchestration.max_actor_restarts="
                f"{self.max_restarts}){hint}; last error: {error}"
            )
        return Replace(name, error, self.last)

    def restart(self, reason: str) -> Restart | Stop:
        """Whether the trainers may restart once more after one died (``reason``, e.g. a
        `TrainerDiedError`'s message, found in a training call, a weight gather or a
        checkpoint); counts the restart."""
        restarts = self.restarts["training"] = self.restarts.get("training", 0) + 1
        if restarts > self.max_restarts:
            return Stop(
                ActorFailedError(
                    f"{reason}; the training actors died {restarts} times (orchestration."
                    f"max_actor_restarts={self.max_restarts}): resume from {self.resume_hint()}"
                )
            )
        return Restart(reason)


def diverged(in_a_row: int, limit: int, step: int, saved: Path) -> TrainingDivergedError:
    """The stop for ``in_a_row`` training steps in a row, up to ``step``, that had a non-finite
    loss or gradient norm (each skipped), at ``orchestration.max_nonfinite_steps_in_a_row``
    (``limit``), after the checkpoint ``saved``."""
    return TrainingDivergedError(
        f"{in_a_row} training steps in a row (up to step {step}) had a non-finite loss or "
        "gradient norm and were skipped "
        f"(orchestration.max_nonfinite_steps_in_a_row={limit}); saved {saved}. Lower "
        "training.optimizer.lr or check the rewards and the data."
    )
