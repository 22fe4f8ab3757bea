"""Multi-turn environments: what answers the policy between its turns, ends an episode and
scores it.

An episode interleaves the policy's turns (trained) with the environment's (never trained); a
subclass says what it answers after each policy turn (`MultiTurnEnv.env_response`) and may
score the episode otherwise (`MultiTurnEnv.score`). How to write one: docs/environments.md.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import Field

from grpo.config.options import checked_options
from grpo.config.sections import REWARD_TIMEOUT_S, RewardTimeout
from grpo.envs.dropped import failure_reason
from grpo.envs.protocol import EngineContext, Environment, EpisodeLimits, FailedEpisodes, Prompt

log = logging.getLogger(__name__)

# How often a wait on jobs re-reads a deadline that moves.
_DEADLINE_POLL_S = 0.1

Message = dict[str, str]


@dataclass
class Episode:
    """One conversation in progress, token-exact.

    Args:
        example (dict): The dataset example, with the row's other columns.
        messages (list[Message]): The conversation as chat turns (assistant turns decoded, for
            the environment to read).
        state (dict): The environment's own per-episode state (`MultiTurnEnv.reset`).
        seed (int): Sampling seed of the first policy turn; turn ``t`` samples with
            ``grpo.seeds.turn_seed(seed, t)``.
    """

    example: dict[str, Any]
    prompt_ids: list[int]
    messages: list[Message]
    state: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    response_mask: list[bool] = field(default_factory=list)
    turn_lengths: list[int] = field(default_factory=list)  # policy tokens of each turn
    tool_calls: int = 0
    tool_errors: dict[str, int] = field(default_factory=dict)
    # Seconds each tool call waited for a free worker before it ran (not part of its timeout).
    tool_queue_waits: list[float] = field(default_factory=list)
    truncated: bool = False  # ended by the token budget or a turn cut at max tokens
    hit_max_turns: bool = False
    # Why the environment raised (`failure_reason`).
    error: str | None = None
    # Failed, and kept in its group with the failure rewards.
    failure_scored: bool = False
    # ``(policy version, tokens)`` runs of the policy's tokens, oldest first: the weights that
    # sampled each (they may change while an episode runs). Empty: the engine does not say.
    version_runs: list[tuple[int, int]] = field(default_factory=list)
    # Each reward function's success flag (None: a reward above 0 counts as a success).
    successes: dict[str, float] | None = None

    def add_policy_turn(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        version_runs: Sequence[tuple[int, int]] = (),
    ) -> None:
        self.response_ids.extend(int(t) for t in token_ids)
        self.logprobs.extend(float(lp) for lp in logprobs)
        self.response_mask.extend([True] * len(token_ids))
        self.turn_lengths.append(len(token_ids))
        for version, count in version_runs:
            if self.version_runs and self.version_runs[-1][0] == version:
                self.version_runs[-1] = (version, self.version_runs[-1][1] + count)
            else:
                self.version_runs.append((int(version), int(count)))

    def add_env_turn(self, token_ids: Sequence[int]) -> None:
        self.response_ids.extend(int(t) for t in token_ids)
        # A placeholder: the loss never reads the logprob of an environment token.
        self.logprobs.extend([0.0] * len(token_ids))
        self.response_mask.extend([False] * len(token_ids))

    def count_tool_error(self, kind: str) -> None:
        self.tool_errors[kind] = self.tool_errors.get(kind, 0) + 1

    @property
    def env_tokens(self) -> int:
        """Environment tokens in the response (not trained)."""
        return len(self.response_ids) - sum(self.turn_lengths)

    @property
    def num_turns(self) -> int:
        """Policy turns so far."""
        return len(self.turn_lengths)

    def last_assistant_text(self) -> str:
        """The policy's last turn, decoded (what reward functions score)."""
        for message in reversed(self.messages):
            if message["role"] == "assistant":
                return message["content"]
        return ""

    def stats(self) -> dict[str, float]:
        """Counts for metrics (`grpo.types.UnscoredTrajectory.episode_stats`)."""
        return {
            "turns": float(self.num_turns),
            "tool_calls": float(self.tool_calls),
            "tool_errors": float(sum(self.tool_errors.values())),
            **{f"tool_errors_{kind}": float(n) for kind, n in self.tool_errors.items()},
            "tool_queue_wait_s": float(sum(self.tool_queue_waits)),
            "tool_queue_wait_max_s": float(max(self.tool_queue_waits, default=0.0)),
            "env_tokens": float(self.env_tokens),
            "policy_tokens": float(sum(self.turn_lengths)),
            "truncated": float(self.truncated),
            "hit_max_turns": float(self.hit_max_turns),
        }


class PendingResponse:
    """The environment's answer to one policy turn, possibly still being computed.

    Args:
        answer (list[Message] | None): The turns (None: the episode ends); entries that wait on
            a job are filled by ``finish``.
        finish (Callable | None): Called once all futures are done, or at ``deadline``, to fill
            ``answer`` from them (it must treat unfinished futures as lost).
        deadline (float | Callable[[], float] | None): ``time.monotonic()`` after which the
            jobs count as lost, or a function that says it when asked (a tool call's clock
            starts when a worker takes it, so the deadline moves).
    """

    def __init__(
        self,
        answer: list[Message] | None,
        futures: Sequence[Any] = (),
        finish: Any = None,
        deadline: float | Callable[[], float] | None = None,
    ) -> None:
        self._answer = answer
        self.futures = list(futures)
        self._finish = finish
        self._deadline = deadline
        self._finished = not self.futures

    def done(self) -> bool:
        """Whether `result` can be taken without waiting."""
        if self._finished:
            return True
        if all(f.done() for f in self.futures):
            return True
        deadline = self._current_deadline()
        return deadline is not None and time.monotonic() >= deadline

    def _current_deadline(self) -> float | None:
        return self._deadline() if callable(self._deadline) else self._deadline

    def result(self) -> list[Message] | None:
        """The answer; waits for the jobs (until the deadline) if they are still running."""
        if not self._finished:
            while not self.done():
                deadline = self._current_deadline()
                timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                if callable(self._deadline) and (timeout is None or timeout > _DEADLINE_POLL_S):
                    timeout = _DEADLINE_POLL_S  # it may move: read it again now and then
                concurrent.futures.wait(self.futures, timeout=timeout)
            if self._finish is not None:
                self._finish()
            self._finished = True
        return self._answer


class MultiTurnEnv(Environment):
    """Base of multi-turn environments: answer each assistant turn until the episode is done.

    Args:
        reward_functions (Sequence): Reward functions that score the episode's last assistant
            turn against the example's answer.
        max_turns (int): Most policy turns in an episode; one that reaches it ends (flagged
            ``hit_max_turns``) and is scored as it stands.
        max_episode_tokens (int | None): Most response tokens (policy and environment) in an
            episode; one that would exceed it ends there, flagged ``truncated``. None: the
            engine's context length is the only bound.
        max_tokens_per_turn (int | None): Most tokens the policy samples in one turn; default
            the collector's ``inference.max_generated_tokens``.
        stop (Sequence[str]): Extra stop strings that end a policy turn (kept in the turn).
        reward_timeout_s (float): Seconds one reward call may take before it scores 0.
        failed_episodes (str): An episode whose environment raises: ``"score"`` keeps it in its
            group scored with the failure rewards, so the behaviour that made it raise is
            penalised; ``"drop"`` leaves it out.

    Raises:
        ValueError: An option of the wrong type or out of bounds (a limit below 1), or a
            reward function that is not callable.
    """

    # Roles of the turns `env_response` answers with, which the chat template is checked on.
    env_roles: tuple[str, ...] = ("user",)

    @checked_options
    def __init__(
        self,
        reward_functions: Sequence[Any] = (),
        max_turns: Annotated[int, Field(ge=1)] = 4,
        max_episode_tokens: Annotated[int, Field(ge=1)] | None = None,
        max_tokens_per_turn: Annotated[int, Field(ge=1)] | None = None,
        stop: Annotated[Sequence[str], Field()] = (),
        reward_timeout_s: RewardTimeout = REWARD_TIMEOUT_S,
        failed_episodes: Annotated[FailedEpisodes, Field()] = "score",
    ) -> None:
        for index, fn in enumerate(reward_functions):
            if not callable(fn):
                raise ValueError(
                    f"{type(self).__name__}: reward_functions[{index}] is a "
                    f"{type(fn).__name__}, not a reward function (build _component_ nodes "
                    "with grpo.config.instantiate first)"
                )
        self.reward_functions = list(reward_functions)
        self.max_turns = max_turns
        self.max_episode_tokens = max_episode_tokens
        self.max_tokens_per_turn = max_tokens_per_turn
        self.stop = tuple(stop)
        self.reward_timeout_s = reward_timeout_s
        self.failed_episodes = failed_episodes
        self.renderer: Any = None  # set by `start`, from the prompts' template
        # Reward calls that timed out or raised, per function, over the run (`score`).
        self.reward_failures: dict[str, int] = {}
        # Reward calls per function since the collector last took them (`take_reward_calls`).
        self._reward_calls: dict[str, Any] = {}
        # Rewards of the last `run_groups`' episodes, computed as each ended, by id(episode).
        self._early_rewards: dict[int, dict[str, float]] = {}

    def response_budget(self, max_tokens_per_turn: int) -> int | None:
        """Every policy and environment turn of an episode: ``max_episode_tokens`` (at least one
        turn's tokens); None without it (the episode runs until the engine's context)."""
        if self.max_episode_tokens is None:
            return None
        return max(max_tokens_per_turn, self.max_episode_tokens)

    def start(self, context: EngineContext) -> None:
        """Keep the engine's context and build the renderer of the environment's turns (chat
        template or plain text, like the prompt)."""
        super().start(context)
        from grpo.envs.render import ChatTurnRenderer, PlainTurnRenderer

        template = context.prompt_template
        if getattr(template, "chat", False):
            self.renderer = ChatTurnRenderer(
                context.tokenizer,
                getattr(template, "chat_template_kwargs", None),
                roles=self.env_roles,
            )
        else:
            self.renderer = PlainTurnRenderer(context.tokenizer)

    def limits(self, context: EngineContext | None = None) -> EpisodeLimits:
        """This environment's limits on ``context``'s engine (default: the started one)."""
        context = context or self._started()
        return EpisodeLimits(
            max_turns=self.max_turns,
            max_tokens_per_turn=self.max_tokens_per_turn or context.max_tokens_per_turn,
            max_model_len=context.max_model_len,
            max_episode_tokens=self.max_episode_tokens,
        )

    def take_reward_calls(self) -> dict[str, dict[str, Any]] | None:
        """The reward functions' calls since the last time they were taken, by name."""
        calls, self._reward_calls = self._reward_calls, {}
        return {name: made.as_dict() for name, made in calls.items()}

    def batch_metrics(self) -> dict[str, float]:
        """``inference/reward_failures_func_<name>``: failed reward calls so far."""
        return {
            f"inference/reward_failures_func_{name}": float(count)
            for name, count in self.reward_failures.items()
        }

    def run_groups(
        self,
        prompts: Sequence[Prompt],
        engine: Any,
        group_size: int,
        seeds: Sequence[int],
    ) -> list[list[Episode]]:
        """Episodes driven by `grpo.envs.rollout.run_episodes`; with the default `score`, each
        is scored in the background as soon as it ends, while the engine runs the others."""
        from grpo.envs.rollout import run_episodes

        context = self._started()
        early = _EarlyScoring(self) if type(self).score is MultiTurnEnv.score else None
        try:
            groups = run_episodes(
                self,
                engine,
                context.tokenizer,
                self.renderer,
                prompts,
                group_size=group_size,
                max_tokens_per_turn=context.max_tokens_per_turn,
                max_model_len=context.max_model_len,
                seeds=seeds,
                on_end=early.add if early is not None else None,
            )
        finally:
            if early is not None:
                self._early_rewards = early.finish()
        return groups

    def reset(self, example: Mapping[str, Any]) -> dict[str, Any]:
        """The episode's initial state; by default the example's answer."""
        return {"answer": example.get("answer")}

    def env_response(
        self, messages: list[Message], state: dict[str, Any], episode: Episode
    ) -> list[Message] | None:
        """The environment's turns after the policy's last turn (``messages[-1]``).

        ``state`` is the episode's, to read and update.

        Returns:
            list[Message] | None: Turns to append (``{"role": "tool" | "user", "content"}``),
            after which the policy takes its next turn; None ends the episode.
        """
        raise NotImplementedError

    def start_response(self, episode: Episode) -> PendingResponse:
        """Begin the answer to the episode's last policy turn; it may finish later.

        By default `env_response` runs now; an episode whose environment raises gets its
        ``error`` and ends there. Environments with slow steps return a `PendingResponse`, so
        the rollout goes on with the other episodes meanwhile.
        """
        try:
            return PendingResponse(self.env_response(episode.messages, episode.state, episode))
        except Exception as error:  # the run goes on; the episode ends here, named
            episode.error = failure_reason(error)
            return PendingResponse(None)

    def reward_names(self) -> list[str] | None:
        """The names `score` gives its rewards, known before any episode runs, or None.

        By default the reward functions' names; None for a subclass with its own `score`
        (override this too to have ``ref.reward_weights`` checked before the actors start).
        """
        if type(self).score is not MultiTurnEnv.score:
            return None
        from grpo.rewards import reward_name

        return [reward_name(fn) for fn in self.reward_functions]

    def failure_rewards(self) -> dict[str, float] | None:
        """Each reward function's ``failure_reward``, by name; None for a subclass with its own
        `score` (its names then score 0)."""
        if type(self).score is not MultiTurnEnv.score:
            return None
        from grpo.rewards import reward_name

        return {
            reward_name(fn): float(getattr(fn, "failure_reward", 0.0))
            for fn in self.reward_functions
        }

    def start_scoring(self) -> None:
        """Start the reward workers (`grpo.rewards.RewardPool.start`) with the reward
        functions' modules imported."""
        if self.reward_functions:
            from grpo.rewards import default_reward_pool

            default_reward_pool().start(self.reward_functions)

    def score(self, episodes: Sequence[Episode]) -> list[dict[str, float]]:
        """Rewards of finished episodes, by reward name.

        By default every reward function scores the last assistant turn against the answer,
        and each episode keeps the functions' success flags (``successes``).
        """
        early, self._early_rewards = self._early_rewards, {}
        if all(id(episode) in early for episode in episodes):
            return [early[id(episode)] for episode in episodes]
        return self._score_now(episodes)

    def _score_now(self, episodes: Sequence[Episode]) -> list[dict[str, float]]:
        if not self.reward_functions:
            raise ValueError(
                f"{type(self).__name__} has no reward_functions: give it some, or override score"
            )
        from grpo.rewards import batched_rewards

        batch = batched_rewards(
            self.reward_functions,
            [episode.last_assistant_text() for episode in episodes],
            [str(episode.example.get("answer", "")) for episode in episodes],
            timeout_s=self.reward_timeout_s,
            # The example's other columns, for reward functions that take them by name.
            columns=[
                {key: value for key, value in episode.example.items() if key != "answer"}
                for episode in episodes
            ],
        )
        for name in batch.func_names:
            failed = batch.num_timeouts[name] + batch.num_exceptions[name]
            self.reward_failures[name] = self.reward_failures.get(name, 0) + failed
        calls = dict(self._reward_calls)
        for name, made in batch.calls().items():
            calls[name] = calls[name].merged(made) if name in calls else made
        self._reward_calls = calls
        rewards = []
        for row, episode in enumerate(episodes):
            episode.successes = {
                name: float(batch.successes[row, column])
                for column, name in enumerate(batch.func_names)
            }
            rewards.append(
                {
                    name: float(batch.rewards[row, column])
                    for column, name in enumerate(batch.func_names)
                }
            )
        return rewards


class _EarlyScoring:
    """Scores episodes on a thread of its own as they end, in batches of those that ended
    while the previous batch was being scored."""

    def __init__(self, env: MultiTurnEnv) -> None:
        self.env = env
        self._ended: queue.SimpleQueue[Episode | None] = queue.SimpleQueue()
        self._rewards: dict[int, dict[str, float]] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="early-scoring", daemon=True)
        self._thread.start()

    def add(self, episode: Episode) -> None:
        if episode.error is None:  # a failed episode is dropped, never scored
            self._ended.put(episode)

    def _run(self) -> None:
        done = False
        while not done:
            batch = [self._ended.get()]
            while not self._ended.empty():
                batch.append(self._ended.get())
            done = batch[-1] is None
            episodes = [episode for episode in batch if episode is not None]
            if not episodes or self._error is not None:
                continue
            try:
                rewards = self.env._score_now(episodes)
            except BaseException as error:  # raised again on the caller's thread
                self._error = error
                continue
            for episode, reward in zip(episodes, rewards):
                self._rewards[id(episode)] = reward

    def finish(self) -> dict[int, dict[str, float]]:
        """Wait for the episodes added so far; their rewards by ``id(episode)``.

        Raises:
            Exception: What scoring raised.
        """
        self._ended.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._rewards
