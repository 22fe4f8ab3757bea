"""The metric names: the contract between the actors, the logger, the plots and the tests.

Which names each actor logs (`METRIC_NAMES`), which step metric each name is plotted against
on W&B (`STEP_METRIC_RULES`, `step_metric_for`), the per-reward-function names
(`reward_metric_names`), and the one place for the percent-of-total arithmetic of the
performance metrics (`ratio_metrics`). Pure Python: the driver, the actors and the plots
import it without the logger.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

# The step metrics W&B plots against (see the module docstring).
TRAIN_STEP = "train_step"
REF_STEP = "ref_step"
INFERENCE_STEP = "inference_step"
# Step metric of a key that no rule covers and whose call named no known actor.
GLOBAL_STEP = "global_step"

# Per-step group counts of dynamic sampling (`grpo.orchestrator.group_counts.GroupCounts`).
GROUPS_SCORED = "ref_actor_rewards/groups_scored"
GROUPS_KEPT = "ref_actor_rewards/groups_kept"
ZERO_VARIANCE_GROUPS = "ref_actor_rewards/zero_variance_groups"

# (W&B metric name or glob, step metric), checked in order: exact names before the namespace
# globs that would otherwise claim them. The `queues/` keys come from different actors, so each
# one is routed to the actor that logs it.
STEP_METRIC_RULES: tuple[tuple[str, str], ...] = (
    ("queues/train_replay_buffer_size", TRAIN_STEP),
    ("queues/replay_buffer_*", TRAIN_STEP),
    ("queues/rollout_queue_size", REF_STEP),
    ("train_actor_*", TRAIN_STEP),
    ("ref_actor_*", REF_STEP),
    ("inference/*", INFERENCE_STEP),
    ("eval/*", TRAIN_STEP),
    ("faults/*", TRAIN_STEP),
)

# The ``actor`` argument of `MetricLogger.log_dict` -> the step metric of keys no rule covers.
ACTOR_STEP_METRIC: dict[str, str] = {
    "train": TRAIN_STEP,
    "ref": REF_STEP,
    "inference": INFERENCE_STEP,
    "eval": TRAIN_STEP,
}

# The metric names each actor logs: the contract between the actors, the plots and the tests.
# Names with ``{name}`` are templates filled with a reward function's name (see
# `reward_metric_names`). Actors may log more keys than these (e.g. ``.../memory/*``); these are
# the ones other code relies on.
METRIC_NAMES: dict[str, tuple[str, ...]] = {
    # PyTorchActorModel, keyed on the optimizer step (`train_step`).
    "train": (
        "train_actor_training/loss",
        "train_actor_training/policy_loss",
        "train_actor_training/kl_loss",
        "train_actor_training/ratios",
        "train_actor_training/clipfrac",
        "train_actor_training/approx_policy_kls",
        # Token mean of the KL estimate to the reference model (the loss's estimator), logged
        # whether or not the KL term is in the loss (kl_coeff 0).
        "train_actor_training/kl_to_ref",
        # Sampler (vLLM) vs trainer logprobs of the same pre-update policy: token mean of the
        # k3 estimate of KL(behaviour || pi_old), and the largest |pi_old - behaviour|.
        "train_actor_training/mismatch_kl",
        "train_actor_training/mismatch_max_abs",
        "train_actor_training/response_lengths",
        "train_actor_training/policy_age_mean",
        "train_actor_training/policy_age_max",
        "train_actor_training/grad_norm",
        "train_actor_training/lr",
        "train_actor_performance/total_step_time (s)",
        "train_actor_performance/time_grpo_steps (s)",
        "train_actor_performance/pct_time_grpo_steps (%)",
        "train_actor_performance/tokens_per_second",
        "train_actor_performance/time_weight_sync (s)",
        "train_actor_performance/pct_time_weight_sync (%)",
        "train_actor_performance/padded_tokens_percentage (%)",
        "train_actor_performance/shared_prompt_tokens_saved (%)",
        "train_actor_performance/time_waiting_buffer (s)",
        "train_actor_performance/pct_time_waiting_buffer (%)",
        "train_actor_performance/time_weight_gather (s)",
        "train_actor_performance/pct_time_weight_gather (%)",
        # The step's wall time and the parts that add up to it (`step_time_breakdown` in
        # grpo.observability.metrics explains each): time_waiting_buffer, time_train_compute,
        # time_weight_gather, time_weight_transfer, time_engine_reload, time_driver_overhead.
        "train_actor_performance/step_wall_time (s)",
        "train_actor_performance/time_train_compute (s)",
        "train_actor_performance/time_weight_transfer (s)",
        "train_actor_performance/time_engine_reload (s)",
        "train_actor_performance/time_driver_overhead (s)",
        # Busy seconds of generation and scoring calls that finished during the step, summed
        # over actors; they overlap training and are not parts of the wall time.
        "train_actor_performance/time_generation_busy (s)",
        "train_actor_performance/time_scoring_busy (s)",
        "queues/train_replay_buffer_size",
        "queues/replay_buffer_dropped_stale",
    ),
    # RefActor, keyed on its own step (`ref_step`).
    "ref": (
        "ref_actor_performance/total_rollout_time (s)",
        "ref_actor_performance/time_model_running (s)",
        "ref_actor_performance/pct_time_model_running (%)",
        "ref_actor_performance/time_waiting_buffer (s)",
        "ref_actor_performance/pct_time_waiting_buffer (%)",
        "ref_actor_performance/total_tokens_processed",
        "ref_actor_performance/shared_prompt_tokens_saved (%)",
        "queues/rollout_queue_size",
        "ref_actor_rewards/rewards_mean",
        "ref_actor_rewards/successes_mean",
        "ref_actor_rewards/rewards_func_{name}_mean",
        "ref_actor_rewards/successes_func_{name}_mean",
        # Counted by the driver over the reference calls that finished since the previous
        # training step, logged once per step (`grpo.orchestrator.group_counts.GroupCounts`):
        # groups scored, passed on to the buffer, and with all-equal rewards (dropped when
        # ref.filter_zero_variance_groups is on). scored / kept is the extra generation
        # that dynamic sampling costs.
        GROUPS_SCORED,
        GROUPS_KEPT,
        ZERO_VARIANCE_GROUPS,
    ),
    # SyncLLMCollector (vLLM), keyed on its generation round (`inference_step`).
    "inference": (
        "inference/tokens_per_second",
        "inference/time_generation (s)",
        "inference/time_weight_update (s)",
        "inference/policy_version",
        "inference/response_length_mean",
        # Weights loaded while the batch generated (inference.weight_updates: in_flight), the
        # time generation paused for them, and the sampled tokens by how many versions their
        # weights were behind the collector's at the end of the batch.
        "inference/weight_updates_in_flight",
        "inference/time_engine_paused (s)",
        "inference/weight_updates_rejected",
        "inference/trajectories_spanning_versions",
        "inference/tokens_version_lag_0",
        "inference/tokens_version_lag_1",
        "inference/tokens_version_lag_2+",
        # Multi-turn environments only (`grpo.envs`): per batch of episodes.
        "inference/episode_turns_mean",
        "inference/episode_turn_length_mean",
        "inference/episode_env_token_fraction",
        "inference/episode_truncated",
        "inference/episodes_dropped",
        "inference/tool_calls_per_episode",
        "inference/tool_errors",
        "inference/tool_timeouts",
        "inference/tool_queue_wait_mean (s)",
        "inference/tool_queue_wait_max (s)",
    ),
    # Held-out evaluation, keyed on the train step whose weights were evaluated.
    "eval": (
        "eval/accuracy",
        "eval/num_examples",
    ),
}

# Keys a metric may not use: they are the JSONL record's own fields.
RESERVED_KEYS = frozenset({"step", "time", "actor"})


def reward_metric_names(func_name: str) -> tuple[str, str]:
    """The per-function reward and success metric names of a reward function.

    Args:
        func_name (str): The reward function's name, as in ``reward_metadata["func_names"]``.

    Returns:
        tuple[str, str]: ``(rewards key, successes key)``.

    Example:
        >>> reward_metric_names("math_correct")
        ('ref_actor_rewards/rewards_func_math_correct_mean', 'ref_actor_rewards/successes_func_math_correct_mean')
    """
    return (
        f"ref_actor_rewards/rewards_func_{func_name}_mean",
        f"ref_actor_rewards/successes_func_{func_name}_mean",
    )


def is_known_metric(key: str) -> bool:
    """Whether `key` is one of `METRIC_NAMES` (templates match any function name).

    Args:
        key (str): A metric name.

    Returns:
        bool: True if some actor's list names it.
    """
    for names in METRIC_NAMES.values():
        for name in names:
            if key == name or (
                "{name}" in name and fnmatch.fnmatchcase(key, name.replace("{name}", "*"))
            ):
                return True
    return False


def step_metric_for(key: str, actor: str | None = None) -> str:
    """The W&B step metric (x axis) that metric `key` is plotted against.

    Args:
        key (str): A metric name.
        actor (str | None): The actor that logged it (a key of `ACTOR_STEP_METRIC`); decides
            for keys that no rule of `STEP_METRIC_RULES` covers.

    Returns:
        str: ``"train_step"``, ``"ref_step"``, ``"inference_step"`` or ``"global_step"``.

    Example:
        >>> step_metric_for("ref_actor_rewards/rewards_mean")
        'ref_step'
    """
    rule = rule_for(key)
    if rule is not None:
        return rule[1]
    return ACTOR_STEP_METRIC.get(actor or "", GLOBAL_STEP)


def rule_for(key: str) -> tuple[str, str] | None:
    for pattern, step_metric in STEP_METRIC_RULES:
        if fnmatch.fnmatchcase(key, pattern):
            return pattern, step_metric
    return None


def ratio_metrics(prefix: str, durations: Mapping[str, float], total: float) -> dict[str, float]:
    """Percent-of-total entries for a set of timings, named like ``{prefix}/pct_{name} (%)``.

    One place for the ``time / total * 100`` arithmetic of the performance metrics, with the
    zero-total guard (a step that took no measurable time reports 0 %, not a division error).

    Args:
        prefix (str): Metric namespace, e.g. ``"train_actor_performance"``.
        durations (Mapping[str, float]): Seconds per timing, keyed by name (``"time_x"`` or
            ``"time_x (s)"``; the ``" (s)"`` suffix is dropped).
        total (float): Seconds of the whole step.

    Returns:
        dict[str, float]: ``{f"{prefix}/pct_{name} (%)": 100 * seconds / total}``.

    Example:
        >>> ratio_metrics("ref_actor_performance", {"time_model_running": 1.5}, total=2.0)
        {'ref_actor_performance/pct_time_model_running (%)': 75.0}
    """
    metrics = {}
    for name, seconds in durations.items():
        name = name.removesuffix(" (s)")
        # `total > 0` is False for NaN as well, so a broken timer reads 0 % rather than NaN.
        metrics[f"{prefix}/pct_{name} (%)"] = 100.0 * seconds / total if total > 0 else 0.0
    return metrics
