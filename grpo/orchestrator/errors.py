"""The two ways a run stops on its own: an actor that cannot go on, and a diverged loss."""


class ActorFailedError(RuntimeError):
    """An actor of the run died or raised; the message names it."""


class TrainingDivergedError(RuntimeError):
    """Too many training steps in a row had a non-finite loss or gradient norm."""
