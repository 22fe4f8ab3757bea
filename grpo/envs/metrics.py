"""Metrics of a batch of episodes: tokens and speed, turns, environment tokens, truncation,
tools, drops."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpo.observability import metric_names as names


def episode_metrics(
    episodes: Sequence[Any], dropped: int, dropped_total: float
) -> dict[str, float]:
    """``inference/episode_*`` and ``inference/tool_*`` metrics of one batch of episodes.

    Args:
        episodes (Sequence[Episode]): The batch's episodes that go into their groups.
        dropped (int): The batch's episodes the environment failed and that were left out.
        dropped_total (float): Those of the run so far.
    """
    count = max(len(episodes), 1)
    turn_lengths = [n for e in episodes for n in e.turn_lengths]
    env_tokens = sum(e.env_tokens for e in episodes)
    policy_tokens = sum(turn_lengths)
    errors: dict[str, int] = {}
    waits = [wait for e in episodes for wait in e.tool_queue_waits]
    for episode in episodes:
        for kind, number in episode.tool_errors.items():
            errors[kind] = errors.get(kind, 0) + number
    metrics = {
        names.INFERENCE_EPISODE_TURNS_MEAN: sum(e.num_turns for e in episodes) / count,
        names.INFERENCE_EPISODE_TURNS_MAX: float(max((e.num_turns for e in episodes), default=0)),
        names.INFERENCE_EPISODE_TURN_LENGTH_MEAN: policy_tokens / max(len(turn_lengths), 1),
        names.INFERENCE_EPISODE_ENV_TOKEN_FRACTION: env_tokens / max(env_tokens + policy_tokens, 1),
        names.INFERENCE_EPISODE_TRUNCATED: float(sum(e.truncated for e in episodes)),
        names.INFERENCE_EPISODE_HIT_MAX_TURNS: float(sum(e.hit_max_turns for e in episodes)),
        names.INFERENCE_EPISODES_DROPPED: float(dropped),
        names.INFERENCE_EPISODES_DROPPED_TOTAL: dropped_total,
        names.INFERENCE_EPISODES_FAILED_SCORED: float(sum(e.failure_scored for e in episodes)),
        names.INFERENCE_TOOL_CALLS_PER_EPISODE: sum(e.tool_calls for e in episodes) / count,
        names.INFERENCE_TOOL_ERRORS: float(sum(errors.values())),
        names.INFERENCE_TOOL_TIMEOUTS: float(errors.get("timeout", 0)),
        # Time calls waited for a free tool worker (not part of their timeout): a pool too
        # small for the load (`ToolEnv(tool_workers=...)`) shows here.
        names.INFERENCE_TOOL_QUEUE_WAIT_MEAN: sum(waits) / max(len(waits), 1),
        names.INFERENCE_TOOL_QUEUE_WAIT_MAX: max(waits, default=0.0),
    }
    for kind, number in errors.items():
        metrics[names.INFERENCE_TOOL_ERRORS_KIND_TEMPLATE.format(kind=kind)] = float(number)
    # An environment's own metrics (a verifiers taskset's), each the mean over the episodes
    # that report it.
    env_metrics: dict[str, list[float]] = {}
    for episode in episodes:
        for name, value in episode.state.get("metrics", {}).items():
            env_metrics.setdefault(name, []).append(float(value))
    for name, values in env_metrics.items():
        metrics[names.INFERENCE_ENV_METRIC_TEMPLATE.format(name=name)] = sum(values) / len(values)
    return metrics


def generation_metrics(
    groups: Sequence[Any], generation_s: float, episode_stats: dict[str, float]
) -> dict[str, float]:
    """Tokens, speed and response lengths of one batch's groups.

    ``inference/generated_tokens`` counts the policy's tokens only, ``inference/prompt_tokens``
    each group's prompt once.

    ``episode_stats`` is the batch's `episode_metrics` (for the truncated count).
    """
    trajectories = [t for group in groups for t in group.trajectories]
    response_lens = [t.response_len for t in trajectories] or [0]
    generated = sum(t.policy_len for t in trajectories)
    return {
        names.INFERENCE_GENERATED_TOKENS: float(generated),
        "inference/prompt_tokens": float(sum(g.trajectories[0].prompt_len for g in groups)),
        names.INFERENCE_TOKENS_PER_SECOND: generated / max(generation_s, 1e-9),
        names.INFERENCE_TIME_GENERATION: generation_s,
        names.INFERENCE_RESPONSE_LENGTH_MEAN: sum(response_lens) / len(response_lens),
        "inference/response_length_max": float(max(response_lens)),
        "inference/truncated_fraction": (
            episode_stats[names.INFERENCE_EPISODE_TRUNCATED] / len(response_lens)
        ),
    }
