"""The ways a run stops on its own; shared by the driver and the weight transports, so it
imports nothing."""


class ActorFailedError(RuntimeError):
    """An actor of the run died or raised; the message names it."""


class TrainingDivergedError(RuntimeError):
    """Too many training steps in a row had a non-finite loss or gradient norm."""


class NoInformativeGroupsError(RuntimeError):
    """With ``ref.filter_zero_variance_groups``, every group for too long had equal
    rewards, so no training batch could be filled."""


class EnvironmentFailingError(RuntimeError):
    """Nearly every episode of several generation batches in a row failed because the
    environment raised; the message names the most common exception and where it raised."""


class RewardFailingError(RuntimeError):
    """Nearly every call of one reward function in several generation batches in a row raised
    or timed out; the message names the function, the exception and where it raised."""


class TrainerDiedError(ActorFailedError):
    """A trainer died and the driver's budget of restarts from the latest checkpoint is spent."""


class RunStalledError(ActorFailedError):
    """No step was trained for ``orchestration.stall_timeout_s`` and replacing an actor cannot
    help (every sample dropped as stale, or the actor that holds the run up used up its
    restarts); the message names the actor and what it was stuck in."""


class WeightTransferError(RuntimeError):
    """A weight transfer to a collector failed or timed out (the collector did not receive, or
    trainer rank 0 could not send); it never stops the run by itself."""
