"""The ways a run stops on its own: an actor that cannot go on, a diverged loss, and no data
left to learn from. Shared by the driver and the weight transports, so it imports nothing."""


class ActorFailedError(RuntimeError):
    """An actor of the run died or raised; the message names it."""


class TrainingDivergedError(RuntimeError):
    """Too many training steps in a row had a non-finite loss or gradient norm."""


class NoInformativeGroupsError(RuntimeError):
    """With ``ref.filter_zero_variance_groups``, every group for too long had equal
    rewards, so no training batch could be filled."""


class TrainerDiedError(ActorFailedError):
    """A trainer died: the driver restarts the trainers, and every actor that depends on their
    state, from the latest checkpoint (`grpo.orchestrator.Orchestrator`) while its restart
    budget lasts; past it, the run stops with this error."""
