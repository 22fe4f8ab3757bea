"""The driver's options: the ``ray:`` and ``orchestration:`` sections of a run config."""

from __future__ import annotations

import re
from dataclasses import dataclass

from grpo.config.options import NON_NEGATIVE, POSITIVE, ConfigSection, greater_than, option


def _ray_address(value: str) -> str | None:
    if value == "auto" or value.startswith("ray://") or re.fullmatch(r"[\w.\-]+:\d+", value):
        return None
    return f"must be null (start a local cluster), 'auto', 'ray://HOST:PORT' or 'HOST:PORT'; got {value!r}"


@dataclass(kw_only=True)
class RayConfig(ConfigSection):
    """Ray cluster.

    The ``ray:`` section of a run config; the README's config reference is made from
    these declarations.
    """

    address: str | None = option(
        None,
        "null: start a local cluster; 'auto' or 'ray://HOST:PORT': join one.",
        check=_ray_address,
    )
    num_cpus: float | None = option(
        None,
        "CPU slots of a local cluster (logical, may exceed the cores); null: the machine's "
        "core count.",
        check=NON_NEGATIVE,
    )
    num_gpus: float | None = option(
        None, "GPUs of a local cluster; null: all visible GPUs.", check=NON_NEGATIVE
    )


@dataclass(kw_only=True)
class OrchestrationConfig(ConfigSection):
    """Actors and the run length.

    The ``orchestration:`` section of a run config; the README's config reference is made from
    these declarations.
    """

    num_inference_workers: int = option(
        1, "vLLM collector actors, each with its own dataset shard.", check=POSITIVE
    )
    synchronous: bool = option(
        False,
        "true: generate, score and train in lock-step (on-policy, reproducible to the bit; "
        "for debugging and exact-resume checks); false: overlap them.",
    )
    num_ref_workers: int = option(
        1, "Reference-model actors (ref logprobs, rewards, advantages).", check=POSITIVE
    )
    num_training_workers: int = option(
        1, "Training actors; more than one shards the model with FSDP2.", check=POSITIVE
    )
    num_steps: int = option(doc="Optimizer steps to train for.", check=POSITIVE)
    replay_buffer_size: int = option(
        512,
        "Most trajectories the replay buffer holds; when it is full, scored groups wait for "
        "room (nothing is dropped).",
        check=POSITIVE,
    )
    max_policy_lag: int = option(
        1,
        "Drop trajectories generated more than this many weight versions ago (0: strictly "
        "on-policy).",
        check=NON_NEGATIVE,
    )
    stall_timeout_s: float = option(
        600.0,
        "Abort the run when no actor finishes any work for this many seconds, or when "
        "every group scored while waiting this long for a batch had equal rewards "
        "(training.filter_zero_variance_groups).",
        check=greater_than(0),
    )
    max_actor_restarts: int = option(
        3,
        "Times each collector, reference actor and the replay buffer may be restarted after "
        "dying (their work is rebuilt, nothing is lost); one more death stops the run with a "
        "checkpoint. Trainers are never restarted.",
        check=NON_NEGATIVE,
    )
