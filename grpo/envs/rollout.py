"""Run multi-turn episodes on an inference engine, token-exact, batched across episodes.

Each policy turn joins the engine's running batch as soon as its episode is ready; one episode
waiting on a tool holds no other. An environment that raises ends that episode only (``error``
says why).
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from grpo.envs.base import Episode, MultiTurnEnv, PendingResponse
from grpo.envs.protocol import EpisodeLimits
from grpo.seeds import sample_seed, turn_seed

if TYPE_CHECKING:
    from grpo.types import GroupedUnscoredTrajectories


class SampleRequest(NamedTuple):
    """One policy turn to sample: the sequence so far and the limits of the turn."""

    token_ids: list[int]
    max_tokens: int
    seed: int
    stop: tuple[str, ...]


class Sample(NamedTuple):
    """What the engine sampled for a request."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token or string) or "length"
    # ``(policy version, tokens)`` runs of the turn's tokens, oldest first (weights may change
    # while it samples); empty when the engine does not track versions.
    version_runs: tuple[tuple[int, int], ...] = ()


Sampler = Callable[[Sequence[SampleRequest]], list[Sample]]


class TurnEngine(Protocol):
    """An engine that samples policy turns continuously.

    A submitted turn joins the engine's running batch at its next step; each step advances
    every running turn by a token and returns the turns that finished.
    """

    def submit(self, request: SampleRequest) -> Hashable:
        """Start sampling ``request``; returns the key its `Sample` will come back under."""
        ...

    def step(self) -> list[tuple[Hashable, Sample]]:
        """Advance the running turns; the ones that finished, by key."""
        ...


class BatchEngine:
    """A `Sampler` as a `TurnEngine`: each step samples, to the end, every turn submitted
    since the previous step (one batch)."""

    def __init__(self, sample: Sampler) -> None:
        self.sample = sample
        self._submitted: list[tuple[int, SampleRequest]] = []
        self._keys = itertools.count()

    def submit(self, request: SampleRequest) -> int:
        key = next(self._keys)
        self._submitted.append((key, request))
        return key

    def step(self) -> list[tuple[Hashable, Sample]]:
        submitted, self._submitted = self._submitted, []
        if not submitted:
            return []
        samples = self.sample([request for _, request in submitted])
        return [(key, sample) for (key, _), sample in zip(submitted, samples)]


def as_turn_engine(engine: TurnEngine | Sampler) -> TurnEngine:
    """``engine`` itself if it is a `TurnEngine`, else the `Sampler` in a `BatchEngine`."""
    return engine if hasattr(engine, "submit") else BatchEngine(engine)


def run_episodes(
    env: MultiTurnEnv,
    engine: TurnEngine | Sampler,
    tokenizer: Any,
    renderer: Any,
    prompts: Sequence[tuple[Mapping[str, Any], list[int]]],
    *,
    group_size: int,
    max_tokens_per_turn: int,
    max_model_len: int,
    seeds: Sequence[int],
    gather_s: float = 0.02,
    on_end: Callable[[Episode], None] | None = None,
) -> list[list[Episode]]:
    """Run ``group_size`` episodes per prompt to their end.

    Args:
        engine (TurnEngine | Sampler): A continuous engine, or a `Sampler` (the turns ready
            together form a batch).
        prompts (Sequence): ``(example, prompt token ids)`` per prompt.
        max_tokens_per_turn (int): Tokens the policy may sample in one turn (the environment's
            ``max_tokens_per_turn`` wins when set).
        seeds (Sequence[int]): One seed per prompt; turn ``t`` of its episode ``j`` samples
            with ``grpo.seeds.sample_seed(seed, j, t)``.
        gather_s (float): When the engine is idle and one episode's answer is in, how long to
            wait for others' (a bigger batch) before sampling its next turn.
        on_end (Callable | None): Called with each episode as soon as it ends.

    Returns:
        list[list[Episode]]: Per prompt, its finished episodes (a failed one has ``error`` set
        and holds the tokens sampled up to the failure).
    """
    limits = EpisodeLimits(
        max_turns=env.max_turns,
        max_tokens_per_turn=env.max_tokens_per_turn or max_tokens_per_turn,
        max_model_len=max_model_len,
        max_episode_tokens=env.max_episode_tokens,
    )
    groups: list[list[Episode]] = []
    for (example, prompt_ids), seed in zip(prompts, seeds):
        question = example.get("question")
        messages = (
            [dict(turn) for turn in question]
            if isinstance(question, list)
            else [{"role": "user", "content": str(question)}]
        )
        groups.append(
            [
                Episode(
                    example=dict(example),
                    prompt_ids=list(prompt_ids),
                    messages=[dict(m) for m in messages],
                    state=env.reset(example),
                    seed=sample_seed(seed, member, 0),
                )
                for member in range(group_size)
            ]
        )
    stop_tokens = set(tokenizer.stop_tokens)
    engine = as_turn_engine(engine)
    # Episodes that need a policy turn, those being sampled (by engine key), and those whose
    # environment is still answering.
    ready = [episode for group in groups for episode in group]
    sampling: dict[Hashable, Episode] = {}
    waiting: list[tuple[Episode, PendingResponse, bool]] = []
    while ready or sampling or waiting:
        for episode in ready:
            request = SampleRequest(
                token_ids=episode.prompt_ids + episode.response_ids,
                max_tokens=limits.turn_tokens(len(episode.prompt_ids), len(episode.response_ids)),
                seed=turn_seed(episode.seed, episode.num_turns),
                stop=env.stop,
            )
            sampling[engine.submit(request)] = episode
        ready = []
        if sampling:
            for key, turn in engine.step():
                episode = sampling.pop(key)
                if _add_turn(limits, tokenizer, episode, turn, stop_tokens):
                    closed = bool(turn.token_ids) and turn.token_ids[-1] in stop_tokens
                    waiting.append((episode, env.start_response(episode), closed))
                elif on_end is not None:
                    on_end(episode)
        elif waiting:  # nothing to sample until an answer is in
            _wait_for_answers([pending for _, pending, _ in waiting], gather_s)
        still_waiting = []
        for episode, pending, closed in waiting:
            if not pending.done():
                still_waiting.append((episode, pending, closed))
            elif _apply_answer(limits, renderer, episode, pending.result(), closed):
                ready.append(episode)
            elif on_end is not None:
                on_end(episode)
        waiting = still_waiting
    return groups


def _add_turn(
    limits: EpisodeLimits, tokenizer: Any, episode: Episode, turn: Sample, stop_tokens: set[int]
) -> bool:
    """Append a sampled policy turn; whether the environment answers it (the episode goes on)."""
    episode.add_policy_turn(turn.token_ids, turn.logprobs, turn.version_runs)
    text = tokenizer.decode(turn.token_ids, skip_special_tokens=True)
    episode.messages.append({"role": "assistant", "content": text})
    if turn.finish_reason == "length":
        episode.truncated = True
        return False
    if episode.num_turns >= limits.max_turns:
        # A single-turn environment ends every episode after its turn: no limit was hit.
        episode.hit_max_turns = limits.max_turns > 1
        return False
    return True


def _wait_for_answers(pending: Sequence[PendingResponse], gather_s: float) -> None:
    """Block until an answer is done, then up to ``gather_s`` more for others to join it (a
    bigger batch), without letting a slow tool hold the episodes whose answers are in."""
    futures = [future for response in pending for future in response.futures]
    while not any(response.done() for response in pending):
        # Short waits: a deadline can pass without any future finishing.
        concurrent.futures.wait(
            futures, timeout=0.05, return_when=concurrent.futures.FIRST_COMPLETED
        )
    if gather_s > 0 and not all(response.done() for response in pending):
        unfinished = [f for f in futures if not f.done()]
        concurrent.futures.wait(unfinished, timeout=gather_s)


def _apply_answer(
    limits: EpisodeLimits,
    renderer: Any,
    episode: Episode,
    answer: list[dict[str, str]] | None,
    closed: bool,
) -> bool:
    """Append the environment's answer to the episode; whether it goes on to a policy turn."""
    if episode.error is not None or answer is None:
        return False
    # The conversation before the policy's last turn: the template renders the answer in its
    # light (`grpo.envs.render.ChatTurnRenderer`).
    env_ids = renderer.env_tokens(answer, closed=closed, history=episode.messages[:-1])
    if len(env_ids) >= limits.room(len(episode.prompt_ids), len(episode.response_ids)):
        episode.truncated = True  # no room for the answer and a policy token after it
        return False
    episode.add_env_turn(env_ids)
    episode.messages.extend(dict(m) for m in answer)
    return True


def episode_groups(
    groups: Sequence[Sequence[Episode]],
    rewards: Sequence[dict[str, float]],
    *,
    group_ids: Sequence[int],
    sequence_id: Callable[[], str],
    policy_version: int,
    last_policy_version: int | None = None,
) -> list[GroupedUnscoredTrajectories]:
    """Finished episodes as trajectory groups, with their rewards and stats.

    Args:
        rewards (Sequence[dict[str, float]]): One per episode kept, in order: those without
            ``error``, and ``failure_scored`` ones.
        policy_version (int): Version of the weights that sampled the oldest policy token of
            an episode whose engine did not say (empty ``version_runs``).
        last_policy_version (int | None): Version that sampled the newest, likewise; None:
            ``policy_version``.

    Returns:
        list[GroupedUnscoredTrajectories]: One per prompt that kept at least one episode.
    """
    # Imported here: `grpo validate` reads this package without loading torch.
    import torch

    from grpo.types import GroupedUnscoredTrajectories, UnscoredTrajectory

    scored = iter(rewards)
    result = []
    for group, group_id in zip(groups, group_ids):
        trajectories = []
        # Each episode keeps its own prompt (a split verifiers trace's holds its re-rendered
        # history); episodes of a group with the same prompt share one tensor.
        prompt_tensors: dict[tuple[int, ...], torch.Tensor] = {}
        for episode in group:
            if episode.error is not None and not episode.failure_scored:
                continue
            prompt_key = tuple(episode.prompt_ids)
            if prompt_key not in prompt_tensors:
                prompt_tensors[prompt_key] = torch.tensor(episode.prompt_ids, dtype=torch.long)
            response = torch.tensor(episode.response_ids, dtype=torch.long)
            runs = episode.version_runs
            trajectories.append(
                UnscoredTrajectory(
                    prompt_tokens=prompt_tensors[prompt_key],
                    response_tokens=response,
                    prompt_len=len(episode.prompt_ids),
                    response_len=response.numel(),
                    logprobs=torch.tensor(episode.logprobs, dtype=torch.float32),
                    answer=str(episode.example.get("answer", "")),
                    sequence_id=sequence_id(),
                    policy_version=min(v for v, _ in runs) if runs else policy_version,
                    last_policy_version=runs[-1][0] if runs else last_policy_version,
                    group_id=group_id,
                    response_mask=torch.tensor(episode.response_mask, dtype=torch.bool),
                    env_rewards=next(scored),
                    env_successes=episode.successes,
                    episode_stats=episode.stats(),
                )
            )
        if trajectories:
            result.append(GroupedUnscoredTrajectories.from_trajectories(trajectories))
    return result
