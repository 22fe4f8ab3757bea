"""The ways a run stops on its own, and the one-line description of an error for messages;
shared by the driver and the weight transports, so it imports nothing."""


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


_DEAD_BECAUSE = "The actor is dead because "


def root_cause(error: BaseException) -> BaseException:
    """The user's exception inside Ray's wrappers: a remote call's ``RayTaskError`` holds the
    exception its actor raised in ``cause`` (itself a ``RayTaskError`` when that actor's own
    remote call failed), and Ray's text of it starts with the call, not the exception."""
    seen = {id(error)}
    while isinstance(cause := getattr(error, "cause", None), BaseException):
        if id(cause) in seen:
            break
        seen.add(id(cause))
        error = cause
    return error


def describe(error: BaseException) -> str:
    """``Type: message`` of the root cause of ``error`` (`root_cause`) in one line, e.g.
    ``WeightSyncError: 3 weight updates in a row failed verification``.

    Ray's text of an actor's death spans lines (its class, ids, pid, then why it is dead): its
    first line and the reason are kept, e.g. ``ActorDiedError: The actor died unexpectedly
    before finishing this task: its worker process has died``.

    Example:
        >>> describe(KeyError("anwser"))
        "KeyError: 'anwser'"
    """
    cause = root_cause(error)
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    why = next((line for line in lines if line.startswith(_DEAD_BECAUSE)), None)
    if why is not None:
        reason = why.removeprefix(_DEAD_BECAUSE).split(". ")[0].rstrip(".")
        text = f"{text.rstrip('.')}: {reason}"
    return f"{type(cause).__name__}: {text}" if text else type(cause).__name__
