"""What the loop tracks: the run's clock (`RunState`) and its calls in flight (`Call`).

`RunState` is the one place the step and the policy version live; it is `Stateful`
(saved as a checkpoint's ``state.json``). `CallKind` names each kind of call the loop keeps
in flight and the role of the actor that runs it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from grpo.orchestrator.ledger import ScoredBatch
from grpo.orchestrator.supervisor import Role


@dataclass
class RunState:
    """The run's clock: training step and policy version; also the last metrics and evals.

    ``last_metrics`` are the last training step's, ``last_scored_metrics`` the last reference
    call's (rewards of the groups scored most recently); neither is checkpointed.
    """

    step: int = 0
    policy_version: int = 0
    last_metrics: dict[str, float] = field(default_factory=dict)
    last_scored_metrics: dict[str, float] = field(default_factory=dict)
    eval_history: list[tuple[int, float]] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "policy_version": self.policy_version,
            "eval_history": self.eval_history,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.policy_version = state["policy_version"]
        self.eval_history = [tuple(item) for item in state["eval_history"]]


class CallKind(enum.Enum):
    """A call the loop keeps in flight, by the role of the actor that runs it."""

    GENERATE = Role.INFERENCE
    TAKE = Role.ROLLOUT_QUEUE
    SCORE = Role.REF
    ADD = (Role.REPLAY_BUFFER, "add")
    SAMPLE = (Role.REPLAY_BUFFER, "sample")
    TRAIN = Role.TRAINING

    @property
    def role(self) -> Role:
        return self.value[0] if isinstance(self.value, tuple) else self.value


@dataclass
class Call:
    """A call in flight: what kind, on which actor, and what the driver needs if it fails."""

    kind: CallKind
    index: int
    actor: Any
    # What each kind holds for its handler, or to be redone on a replacement:
    groups_ref: Any = None  # TAKE, SCORE: the groups taken or scored
    queue: Any = None  # GENERATE: the rollout queue the batch puts onto
    group_ids: list[int] = field(default_factory=list)  # GENERATE: the groups it generates
    records: list[Any] | None = None  # GENERATE: the lost groups it generates again
    scored_ref: Any = None  # SCORE: the scored groups (its second return)
    scored: ScoredBatch | None = None  # ADD: the scored batch offered to the buffer
    batch_ref: Any = None  # SAMPLE: the sampled batch (its second return), for the trainers
    started: float = field(default_factory=time.monotonic)  # for the stall watch

    @property
    def actor_id(self) -> str:
        """The Ray id of the actor (the rollout queue's actor inside its wrapper)."""
        handle = getattr(self.actor, "actor", self.actor)
        actor_id = getattr(handle, "_actor_id", None)
        return actor_id.hex() if actor_id is not None else str(id(handle))
