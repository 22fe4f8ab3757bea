"""Scoring a batch: every completion under every reward function, failures counted."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# torch is imported where a batch is built: reward worker processes import this package (the
# forkserver preloads it) and need none of torch.
if TYPE_CHECKING:
    import torch

from grpo.rewards.base import (
    RewardFunction,
    as_reward_function,
    call_reward,
    reward_failure_reason,
)
from grpo.rewards.calls import RewardCalls
from grpo.rewards.pool import Call, Outcome, RewardPool, default_reward_pool

logger = logging.getLogger(__name__)


def total_reward(
    rewards: torch.Tensor, reward_weights: Sequence[float] | None = None
) -> torch.Tensor:
    """Sum of the per-function rewards ``(N, F)`` -> ``(N,)``, weighted by F weights if given.

    Raises:
        ValueError: If the number of weights is not F.
    """
    import torch

    if rewards.dim() != 2:
        raise ValueError(
            f"total_reward: rewards must have shape (N, F), got {tuple(rewards.shape)}"
        )
    if reward_weights is None:
        return rewards.sum(dim=-1)
    weights = torch.as_tensor(reward_weights, dtype=rewards.dtype, device=rewards.device)
    if weights.shape != (rewards.shape[-1],):
        raise ValueError(
            f"total_reward: {weights.numel()} reward_weights for {rewards.shape[-1]} reward functions"
        )
    return rewards @ weights


@dataclass
class RewardBatch:
    """Rewards of N completions under F reward functions.

    Args:
        rewards (torch.Tensor): float32, shape ``(N, F)``.
        successes (torch.Tensor): float32 0/1, shape ``(N, F)``.
        num_timeouts (dict[str, int]): Calls that overran the timeout, per function.
        num_exceptions (dict[str, int]): Calls that raised (or whose worker died), per function.
        failure_reasons (dict[str, str]): Per function that failed a call, its first exception
            (with the line that raised), else its first timeout.
    """

    rewards: torch.Tensor
    successes: torch.Tensor
    func_names: list[str]
    num_timeouts: dict[str, int]
    num_exceptions: dict[str, int]
    failure_reasons: dict[str, str] = field(default_factory=dict)

    @property
    def num_calls(self) -> int:
        """Calls of each function: one per completion."""
        return int(self.rewards.shape[0])

    def calls(self) -> dict[str, RewardCalls]:
        """Each function's calls, failures and why, by name."""
        return {
            name: RewardCalls(
                self.num_calls,
                self.num_timeouts.get(name, 0),
                self.num_exceptions.get(name, 0),
                self.failure_reasons.get(name),
            )
            for name in self.func_names
        }

    def total(self, reward_weights: Mapping[str, float] | None = None) -> torch.Tensor:
        """Total reward per completion, shape ``(N,)``: the weighted sum of its rewards.

        Args:
            reward_weights (Mapping[str, float] | None): Weight by reward name; a reward it
                does not name weighs 1. None: all 1.

        Raises:
            ValueError: A name that is none of ``func_names``, naming it and the rewards.
        """
        if reward_weights is None:
            return total_reward(self.rewards)
        unknown = [name for name in reward_weights if name not in self.func_names]
        if unknown:
            raise ValueError(
                f"ref.reward_weights: no reward named {', '.join(map(repr, unknown))}; the "
                f"rewards are {', '.join(self.func_names)}"
            )
        return total_reward(
            self.rewards, [float(reward_weights.get(name, 1.0)) for name in self.func_names]
        )


def env_reward_batch(trajectories: Sequence[Any]) -> RewardBatch:
    """The rewards environments gave episodes (``env_rewards``), as a `RewardBatch` with one
    column per name; successes are ``env_successes`` where kept, else a reward above 0.

    Raises:
        ValueError: A trajectory without ``env_rewards``, or with other names.
    """
    names = list(trajectories[0].env_rewards or {})
    rows: list[list[float]] = []
    success_rows: list[list[float]] = []
    for traj in trajectories:
        if traj.env_rewards is None or list(traj.env_rewards) != names:
            raise ValueError(
                f"sequence_id={traj.sequence_id!r} has env_rewards "
                f"{None if traj.env_rewards is None else list(traj.env_rewards)}, expected the "
                f"names {names} of the other episodes of the batch"
            )
        rows.append([float(traj.env_rewards[name]) for name in names])
        flags = traj.env_successes
        success_rows.append(
            [float(flags[name]) for name in names]
            if flags is not None
            else [float(reward > 0) for reward in rows[-1]]
        )
    import torch

    rewards = torch.tensor(rows, dtype=torch.float32).reshape(len(trajectories), len(names))
    return RewardBatch(
        rewards=rewards,
        successes=torch.tensor(success_rows, dtype=torch.float32).reshape(rewards.shape),
        func_names=names,
        num_timeouts=dict.fromkeys(names, 0),
        num_exceptions=dict.fromkeys(names, 0),
    )


def _run_inline(reward_fns: list[RewardFunction], calls: list[Call]) -> list[Outcome]:
    """Run calls in this thread, without timeouts (exceptions are still caught)."""
    outcomes: list[Outcome] = []
    for fn_index, completion, answer, columns in calls:
        try:
            reward, success = call_reward(reward_fns[fn_index], completion, answer, columns)
            outcomes.append((reward, success, None, None))
        except Exception as error:
            logger.debug("reward %s raised", reward_fns[fn_index].name, exc_info=True)
            outcomes.append((0.0, False, "exception", reward_failure_reason(error)))
    return outcomes


def batched_rewards(
    reward_fns: Sequence[RewardFunction | Callable[..., Any]],
    completions: Sequence[str],
    answers: Sequence[str],
    timeout_s: float | None = 5.0,
    pool: RewardPool | None = None,
    columns: Sequence[Mapping[str, Any]] | None = None,
) -> RewardBatch:
    """Score every completion with every reward function.

    Each (function, completion) call gets ``timeout_s`` seconds in a worker process; a call
    that raises, overruns or kills its worker gets the function's ``failure_reward`` and
    success 0, and is counted. Works from any thread (no signals).

    Args:
        reward_fns (Sequence): Picklable reward functions with distinct names (a plain callable
            is wrapped with `reward_function`).
        timeout_s (float | None): Per-call limit in seconds. None runs the calls inline with
            no timeout (for debugging).
        pool (RewardPool | None): Pool to use; defaults to `default_reward_pool`.
        columns (Sequence[Mapping] | None): Per completion, its example's other columns (they
            must pickle); each function gets those it takes as keyword arguments.

    Returns:
        RewardBatch: Columns in the order of ``reward_fns``.

    Raises:
        ValueError: On mismatched lengths, no reward functions or duplicate names.
    """
    if not reward_fns:
        raise ValueError("batched_rewards: reward_fns is empty")
    if len(completions) != len(answers):
        raise ValueError(
            f"batched_rewards: {len(completions)} completions but {len(answers)} answers"
        )
    if columns is not None and len(columns) != len(completions):
        raise ValueError(
            f"batched_rewards: {len(completions)} completions but {len(columns)} column rows"
        )
    functions = [as_reward_function(fn) for fn in reward_fns]
    func_names = [fn.name for fn in functions]
    duplicates = sorted({name for name in func_names if func_names.count(name) > 1})
    if duplicates:
        raise ValueError(f"batched_rewards: duplicate reward function names {duplicates}")

    num_funcs = len(functions)
    rows = columns if columns is not None else [{}] * len(completions)
    calls: list[Call] = [
        (fn_index, completion, answer, fn.select_columns(row) if row else {})
        for completion, answer, row in zip(completions, answers, rows)
        for fn_index, fn in enumerate(functions)
    ]
    if not calls:
        outcomes: list[Outcome] = []
    elif timeout_s is None:
        outcomes = _run_inline(functions, calls)
    else:
        outcomes = (pool or default_reward_pool()).run(functions, calls, timeout_s)

    import torch

    rewards = torch.zeros(len(completions), num_funcs, dtype=torch.float32)
    successes = torch.zeros(len(completions), num_funcs, dtype=torch.float32)
    num_timeouts = dict.fromkeys(func_names, 0)
    num_exceptions = dict.fromkeys(func_names, 0)
    first_errors: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for position, (reward, success, error_kind, message) in enumerate(outcomes):
        sample, fn_index = divmod(position, num_funcs)
        name = func_names[fn_index]
        if error_kind is None:
            rewards[sample, fn_index] = reward
            successes[sample, fn_index] = float(success)
            continue
        rewards[sample, fn_index] = functions[fn_index].failure_reward
        counter = num_timeouts if error_kind == "timeout" else num_exceptions
        counter[name] += 1
        first_errors.setdefault(name, f"sample {sample}: {message}")
        if error_kind == "timeout":
            reasons.setdefault(name, message or "timed out")
        elif num_exceptions[name] == 1:  # the first exception: it says more than a timeout
            reasons[name] = message or "raised"
    for name, first_error in first_errors.items():
        logger.warning(
            "reward %r: %d timeout(s), %d exception(s) in a batch of %d; first: %s",
            name,
            num_timeouts[name],
            num_exceptions[name],
            len(completions),
            first_error,
        )
    return RewardBatch(rewards, successes, func_names, num_timeouts, num_exceptions, reasons)
