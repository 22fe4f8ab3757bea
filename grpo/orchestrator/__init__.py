"""Starts the actors of a run, drives them, and shuts them down: single-purpose parts.

Data between actors moves as ObjectRefs the driver owns and never fetches: groups taken from
the rollout queue go to a reference actor, its scored groups to the replay buffer, the
buffer's sample to every trainer (each takes its share), and each generation batch's groups
(the collector returns them beside putting them on the queue) until they are scored. Holding
those references is what lets the driver replace a dead collector, reference actor, buffer or
rollout queue and redo its work with nothing lost. A dead trainer takes the policy with it:
the loop restarts every actor from the latest checkpoint and redoes the steps after it. The
parts, none of which knows the orchestrator:

- `loop`: `Orchestrator.run`, the step loop: a batch, a training step, the weight sync,
  evaluation and checkpoints; every wait goes through one method that carries out the fault
  policy's decisions.
- `scheduler`: `Scheduler`, the calls in flight (one per actor) and one handler per kind of
  call; it reports failures and decides nothing about them.
- `faults`: `FaultPolicy.decide`, a failed call -> `Replace` | `Restart` | `Stop`, with the
  restart budget (``orchestration.max_actor_restarts``); `describe` names a failure's root
  cause inside Ray's wrappers.
- `supervisor`: `ActorSupervisor` starts every actor, names it, starts a replacement in a
  dead one's place, restarts them all from a checkpoint, and ends them.
- `ledger`: `InFlightLedger`, where each group on its way to the trainers is (by id, with
  what it takes to generate it again), with its own ``state_dict()``.
- `checkpointer`: `Checkpointer` composes the parts' ``state_dict()``s into one atomic
  checkpoint and restores them; `find_checkpoint`.
- `state`: `RunState` (step, policy version: tracked only there) and the kinds of call.
- `stall`: `StallWatch`, which names the actor that holds a run up.
- `group_counts`: `GroupCounts` (groups scored and dropped per step, and the
  no-informative-group guard of dynamic sampling).
- `episode_drops`: `EpisodeDrops` (the guard that stops a run whose environment fails nearly
  every episode); `reward_failures`: `RewardFailures` (the guard that stops a run whose reward
  function fails nearly every call).

Beside them, from other packages: `grpo.weights.sync.WeightSync` (gather, send, verify the
weights), `grpo.observability` (step metrics, the run ledger, debug tables) and `grpo.errors`
(`ActorFailedError`, `TrainingDivergedError`, `NoInformativeGroupsError`,
`EnvironmentFailingError`). The driver reads the typed `grpo.config.RunConfig`; its own sections are ``ray:``,
``orchestration:``, ``checkpoint:`` and ``weight_sync:`` (`grpo.config.sections`).
"""

from grpo.errors import (
    ActorFailedError,
    EnvironmentFailingError,
    NoInformativeGroupsError,
    TrainingDivergedError,
)
from grpo.orchestrator.checkpointer import Checkpointer, find_checkpoint
from grpo.orchestrator.faults import FaultPolicy, Replace, Restart, Stop
from grpo.orchestrator.ledger import InFlightLedger, ScoredBatch
from grpo.orchestrator.loop import Orchestrator
from grpo.orchestrator.state import RunState
from grpo.orchestrator.supervisor import (
    ActorSupervisor,
    Recovery,
    Role,
    check_placement,
    init_ray,
)
from grpo.weights.sync import WeightSync

__all__ = [
    "ActorFailedError",
    "ActorSupervisor",
    "Checkpointer",
    "EnvironmentFailingError",
    "FaultPolicy",
    "InFlightLedger",
    "NoInformativeGroupsError",
    "Orchestrator",
    "Recovery",
    "Replace",
    "Restart",
    "Role",
    "RunState",
    "ScoredBatch",
    "Stop",
    "TrainingDivergedError",
    "WeightSync",
    "check_placement",
    "find_checkpoint",
    "init_ray",
]
