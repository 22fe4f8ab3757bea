"""The driver: starts the actors of a run, drives them, and shuts them down.

`Orchestrator` (`loop`) runs the steps; `Scheduler` keeps one call in flight per actor;
`FaultPolicy` decides what a failure leads to; `ActorSupervisor` starts and replaces actors;
`InFlightLedger` knows where each group on its way is. docs/architecture.md tells how they fit.
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
