"""Held-out episodes through the environment protocol, scored by the environment's own rewards.

Evaluation plays and scores episodes exactly as training does, so every kind of environment is
evaluated alike; it returns plain data that crosses Ray as it is. Pure Python.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grpo.envs.protocol import Environment
from grpo.seeds import mix_seed

TASK_COLUMN = "task"
"""An example's column that names its task: results are also reported per task."""
EPISODE_KEY = "episode"
"""A trajectory's ``state`` key naming its episode, where an environment splits one episode
into several trajectories (`grpo.envs.AgentEnv`): evaluation counts the episode once."""
SEED_SALT = -1
"""Hashed into evaluation's seeds (training groups hash the run seed and a group id >= 0)."""


def evaluation_episodes(
    env: Environment,
    engine: Any,
    examples: Sequence[Mapping[str, Any]],
    prompt_ids: Sequence[list[int] | None],
    samples_per_example: int,
    seed: int,
    hold_engine: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> list[dict[str, Any]]:
    """Play ``samples_per_example`` episodes of every example and score them.

    An episode the environment failed, and every sample of an example whose prompt does not
    fit (``prompt_ids`` None), counts as a sample with no reward and no success.

    Args:
        env (Environment): A started environment (not the one training batches use: scoring
            counts reward calls, which the driver's guard reads).
        prompt_ids (Sequence[list[int] | None]): Each example's prompt ids, None if it does not
            fit the engine's context.
        hold_engine (Callable): A context manager held while the episodes run (the engine's
            lock); scoring runs after it is released.

    Returns:
        list[dict]: Per example: ``task`` (its ``task`` column, or None) and ``samples``, one
        dict per episode: ``rewards`` and ``successes`` by reward name, ``response_tokens``
        (the policy's tokens), ``failed`` and ``text`` (the last policy turn, decoded).
    """
    fits = [i for i, ids in enumerate(prompt_ids) if ids is not None]
    groups: list[list[Any]] = []
    if fits:
        prompts = [(dict(examples[i]), list(prompt_ids[i] or [])) for i in fits]
        with hold_engine():
            groups = env.run_groups(
                prompts, engine, samples_per_example, [mix_seed(seed, SEED_SALT, i) for i in fits]
            )
    every = [episode for group in groups for episode in group]
    completed = [episode for episode in every if episode.error is None]
    rewards = env.score(completed) if completed else []
    scored = {id(episode): reward for episode, reward in zip(completed, rewards)}

    failed_sample = {
        "rewards": {},
        "successes": {},
        "response_tokens": 0,
        "failed": True,
        "text": "",
    }
    results = [
        {
            "task": _task(example),
            "samples": [dict(failed_sample) for _ in range(samples_per_example)],
        }
        for example in examples
    ]
    for i, group in zip(fits, groups):
        samples = []
        for episode in _one_per_episode(group):
            reward = scored.get(id(episode))
            if reward is None:
                samples.append(dict(failed_sample))
                continue
            successes = episode.successes
            if successes is None:  # an environment with its own score: a reward above 0
                successes = {name: float(value > 0) for name, value in reward.items()}
            samples.append(
                {
                    "rewards": {name: float(value) for name, value in reward.items()},
                    "successes": {name: float(successes.get(name, 0.0)) for name in reward},
                    "response_tokens": int(sum(episode.turn_lengths)),
                    "failed": False,
                    "text": episode.last_assistant_text(),
                }
            )
        # An environment may drop episodes of a group: the missing ones count as failed.
        samples += [dict(failed_sample) for _ in range(samples_per_example - len(samples))]
        results[i]["samples"] = samples
    return results


def _one_per_episode(group: Sequence[Any]) -> list[Any]:
    """The group's trajectories, the last one of each episode split into several (they share
    its reward): a sample is an episode, not a trajectory."""
    last: dict[Any, Any] = {}
    for position, trajectory in enumerate(group):
        state = getattr(trajectory, "state", None) or {}
        last[state.get(EPISODE_KEY, ("trajectory", position))] = trajectory
    return list(last.values())


def _task(example: Mapping[str, Any]) -> str | None:
    task = example.get(TASK_COLUMN)
    return None if task is None else str(task)


class EvaluationEnvironment:
    """The environment evaluation plays on: a second instance of the run's, built on first use.

    Its own instance keeps evaluation out of what training reads of its environment (reward
    calls, failure totals, rewards computed while a batch runs). An environment given as an
    object cannot be built again and is shared.

    Args:
        spec: The run's ``environment`` (a node, None, or an `Environment`).
    """

    def __init__(
        self,
        spec: Any,
        reward_functions: Sequence[Any],
        reward_timeout_s: float,
        training: Environment,
    ) -> None:
        self.spec = spec
        self.reward_functions = list(reward_functions)
        self.reward_timeout_s = reward_timeout_s
        self.training = training
        self._env: Environment | None = None

    def get(self) -> Environment:
        """The started evaluation environment.

        Raises:
            ValueError: If the environment brings its own tasks and no held-out rows of its own
                (a verifiers taskset; ``grpo validate`` refuses such a config).
        """
        if self.training.examples() is not None and self.training.eval_examples() is None:
            raise ValueError(
                "held-out evaluation plays eval_dataset's examples; an environment with its "
                "own tasks (a verifiers taskset) has no held-out split here"
            )
        if self._env is None:
            if isinstance(self.spec, Environment):
                self._env = self.training
            else:
                from grpo.envs.build import build_environment

                env = build_environment(self.spec, self.reward_functions, self.reward_timeout_s)
                env.start(self.training._started())
                self._env = env
        return self._env

    def close(self) -> None:
        """Close the evaluation environment if it is one of its own."""
        if self._env is not None and self._env is not self.training:
            self._env.close()
        self._env = None
