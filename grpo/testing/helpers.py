"""Test support around the tiny models: a diverging loss, run helpers."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from grpo.objective.loss import GRPOLoss
from grpo.types import GRPOStats


class NonFiniteLoss(GRPOLoss):
    """`GRPOLoss` whose loss is NaN: injects a diverged training step.

    For tests of the non-finite guard (``training.loss._component_=grpo.testing.NonFiniteLoss``).
    """

    def compute_loss_from_logprobs(self, *args: Any, **kwargs: Any) -> GRPOStats:
        stats = super().compute_loss_from_logprobs(*args, **kwargs)
        return dataclasses.replace(stats, loss=stats.loss * float("nan"))


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a JSON-lines file a run wrote, one dict per non-blank line, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# A random tiny model earns (almost) no reward: with dynamic sampling on, every group would be
# dropped and no batch would ever fill.
RANDOM_MODEL_OVERRIDES = ("ref.filter_zero_variance_groups=false",)


def start_tiny_run(
    model_dir: str | os.PathLike, run_dir: str | os.PathLike, num_steps: int, *overrides: str
) -> Any:
    """Start every actor of a ``tiny_arithmetic_cpu`` run, without evaluation.

    Starts a local Ray cluster if none is running (or joins ``ray.address``).

    Args:
        run_dir: A new folder for the run.
        *overrides (str): More ``key=value`` config overrides.

    Returns:
        Orchestrator: With every actor started; call ``run()``, then ``shutdown()``.
    """
    from grpo.config import load_config
    from grpo.models import load_tokenizer
    from grpo.orchestrator import Orchestrator, check_placement, init_ray

    cfg = load_config(
        "tiny_arithmetic_cpu",
        [
            f"base_model_path={model_dir}",
            f"output_dir={run_dir}",
            f"orchestration.num_steps={num_steps}",
            "eval_every_n_steps=null",
            *RANDOM_MODEL_OVERRIDES,
            *overrides,
        ],
    )
    Path(run_dir).mkdir(parents=True)
    init_ray(cfg)
    check_placement(cfg)
    tokenizer = load_tokenizer(model_dir)
    run = Orchestrator(cfg, Path(run_dir), tokenizer)
    run.start_actors(pad_token_id=tokenizer.pad_id)
    return run


def kill_at_steps(run: Any, victims: list[tuple[int, str]]) -> dict[str, float]:
    """In a background thread, ``ray.kill`` each named actor once the run reaches its step.

    Args:
        victims (list[tuple[int, str]]): ``(step, name)`` in order; names are
            ``inference[i]``, ``ref[i]``, ``replay_buffer``, ``rollout_queue`` and
            ``training[i]``.

    Returns:
        dict[str, float]: Filled with ``{name: time.monotonic() of the kill}`` as it goes.
    """
    import threading
    import time

    import ray

    from grpo.orchestrator import Role

    def actor(name: str) -> Any:  # the inverse of grpo.orchestrator.supervisor.actor_name
        role, _, index = name.rstrip("]").partition("[")
        handle = run.actors.actor(Role(role), int(index or 0))
        # The rollout queue is a `RolloutQueue` object around its actor.
        return handle.actor if Role(role) is Role.ROLLOUT_QUEUE else handle

    killed_at: dict[str, float] = {}

    def kill() -> None:
        for step, name in victims:
            deadline = time.monotonic() + 300
            while run.state.step < step and time.monotonic() < deadline:
                time.sleep(0.05)
            killed_at[name] = time.monotonic()
            ray.kill(actor(name), no_restart=True)

    threading.Thread(target=kill, daemon=True).start()
    return killed_at


def gathered_training_state(trainer: Any) -> dict[str, Any]:
    """A trainer's full model and optimizer state, named the same for any number of workers.

    Collective under FSDP: call it on every rank (e.g. through ``actor.__ray_call__``).

    Returns:
        dict[str, Any]: ``{"model", "optimizer", "steps_run"}``, tensors on CPU, copied (an
        unsharded model's state dict would otherwise alias its live parameters).
    """
    import copy

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model, optimizer = get_state_dict(trainer.policy, trainer.optimizer, options=options)
    state = {"model": model, "optimizer": optimizer, "steps_run": trainer.steps_run}
    return copy.deepcopy(state)
