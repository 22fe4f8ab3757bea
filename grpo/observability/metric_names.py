"""The metric names: the contract between the actors, the logger, the plots and the tests.

One constant per metric name that more than one module uses (a test finds the literals
elsewhere), the names each actor logs (`METRIC_NAMES`) and the W&B step metric each is plotted
against (`step_metric_for`). Unit suffixes stay in the values, out of the constants' names; a
``*_TEMPLATE`` is a `str.format` template. Pure Python. docs/metrics.md explains the metrics.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

TRAINING_STEP = "training_step"
REF_STEP = "ref_step"
INFERENCE_STEP = "inference_step"
# Step metric of a key that no rule covers and whose call named no known actor.
GLOBAL_STEP = "global_step"

TRAIN_PERF_NAMESPACE = "training_perf"
REF_PERF_NAMESPACE = "ref_perf"

TRAIN_LOSS = "training/loss"
TRAIN_KL_LOSS = "training/kl_loss"
TRAIN_APPROX_POLICY_KLS = "training/approx_policy_kls"
TRAIN_MISMATCH_MAX_ABS = "training/mismatch_max_abs"
TRAIN_CORRECTION_MASKED_FRACTION = "training/correction_masked_fraction"
TRAIN_CORRECTION_MASKED_SEQUENCE_FRACTION = "training/correction_masked_sequence_fraction"
TRAIN_RESPONSE_LENGTHS = "training/response_lengths"
TRAIN_POLICY_AGE_MEAN = "training/policy_age_mean"
TRAIN_POLICY_AGE_MAX = "training/policy_age_max"
TRAIN_GRAD_NORM = "training/grad_norm"
TRAIN_LR = "training/lr"
# Steps skipped in a row for a non-finite loss or gradient norm; the driver stops the run on it.
TRAIN_NONFINITE_STEPS_IN_A_ROW = "training/nonfinite_steps_in_a_row"

TRAIN_PERF_TOTAL_STEP_TIME = "training_perf/total_step_time (s)"
TRAIN_PERF_TIME_GRPO_STEPS = "training_perf/time_grpo_steps (s)"
TRAIN_PERF_TOKENS_PER_SECOND = "training_perf/tokens_per_second"
TRAIN_PERF_TIME_WEIGHT_SYNC = "training_perf/time_weight_sync (s)"
TRAIN_PERF_PADDED_TOKENS_PERCENTAGE = "training_perf/padded_tokens_percentage (%)"
TRAIN_PERF_SHARED_PROMPT_TOKENS_SAVED = "training_perf/shared_prompt_tokens_saved (%)"
TRAIN_PERF_STEP_WALL_TIME = "training_perf/step_wall_time (s)"
TRAIN_PERF_TIME_WAITING_BUFFER = "training_perf/time_waiting_buffer (s)"
TRAIN_PERF_TIME_TRAIN_COMPUTE = "training_perf/time_train_compute (s)"
TRAIN_PERF_TIME_WEIGHT_GATHER = "training_perf/time_weight_gather (s)"
TRAIN_PERF_TIME_WEIGHT_TRANSFER = "training_perf/time_weight_transfer (s)"
TRAIN_PERF_TIME_ENGINE_RELOAD = "training_perf/time_engine_reload (s)"
TRAIN_PERF_TIME_DRIVER_OVERHEAD = "training_perf/time_driver_overhead (s)"
TRAIN_PERF_TIME_GENERATION_BUSY = "training_perf/time_generation_busy (s)"
TRAIN_PERF_TIME_SCORING_BUSY = "training_perf/time_scoring_busy (s)"

REF_PERF_TOTAL_ROLLOUT_TIME = "ref_perf/total_rollout_time (s)"
REF_PERF_TIME_MODEL_RUNNING = "ref_perf/time_model_running (s)"
REF_PERF_PCT_TIME_MODEL_RUNNING = "ref_perf/pct_time_model_running (%)"
REF_PERF_TIME_WAITING_BUFFER = "ref_perf/time_waiting_buffer (s)"
REF_PERF_TOTAL_TOKENS_PROCESSED = "ref_perf/total_tokens_processed"
REF_PERF_SHARED_PROMPT_TOKENS_SAVED = "ref_perf/shared_prompt_tokens_saved (%)"

REWARDS_MEAN = "ref_rewards/rewards_mean"
SUCCESSES_MEAN = "ref_rewards/successes_mean"
REWARDS_FUNC_MEAN_TEMPLATE = "ref_rewards/rewards_func_{name}_mean"
SUCCESSES_FUNC_MEAN_TEMPLATE = "ref_rewards/successes_func_{name}_mean"
GROUPS_SCORED = "ref_rewards/groups_scored"
GROUPS_KEPT = "ref_rewards/groups_kept"
ZERO_VARIANCE_GROUPS = "ref_rewards/zero_variance_groups"

REF_TEACHER_REVERSE_KL = "ref_distillation/teacher_reverse_kl"

REPLAY_BUFFER_SIZE = "queues/replay_buffer_size"
REPLAY_BUFFER_DROPPED_STALE = "queues/replay_buffer_dropped_stale"
ROLLOUT_QUEUE_SIZE = "queues/rollout_queue_size"
ROLLOUT_QUEUE_PUT_WAIT_S = "queues/rollout_queue_put_wait_s"

INFERENCE_TOKENS_PER_SECOND = "inference/tokens_per_second"
INFERENCE_GENERATED_TOKENS = "inference/generated_tokens"
INFERENCE_TIME_GENERATION = "inference/time_generation (s)"
INFERENCE_TIME_WEIGHT_UPDATE = "inference/time_weight_update (s)"
INFERENCE_POLICY_VERSION = "inference/policy_version"
INFERENCE_RESPONSE_LENGTH_MEAN = "inference/response_length_mean"
# Non-zero when the collector found the rollout queue dead and kept its groups.
INFERENCE_GROUPS_NOT_QUEUED = "inference/groups_not_queued"
INFERENCE_WEIGHT_UPDATES_IN_FLIGHT = "inference/weight_updates_in_flight"
INFERENCE_TIME_ENGINE_PAUSED = "inference/time_engine_paused (s)"
INFERENCE_WEIGHT_UPDATES_REJECTED = "inference/weight_updates_rejected"
INFERENCE_TRAJECTORIES_SPANNING_VERSIONS = "inference/trajectories_spanning_versions"
INFERENCE_TOKENS_VERSION_LAG_0 = "inference/tokens_version_lag_0"
INFERENCE_TOKENS_VERSION_LAG_1 = "inference/tokens_version_lag_1"
INFERENCE_TOKENS_VERSION_LAG_2_PLUS = "inference/tokens_version_lag_2+"
INFERENCE_TIME_ASLEEP = "inference/time_asleep (s)"
INFERENCE_TIME_TO_WAKE = "inference/time_to_wake (s)"
INFERENCE_EPISODE_TURNS_MEAN = "inference/episode_turns_mean"
INFERENCE_EPISODE_TURNS_MAX = "inference/episode_turns_max"
INFERENCE_EPISODE_TURN_LENGTH_MEAN = "inference/episode_turn_length_mean"
INFERENCE_EPISODE_ENV_TOKEN_FRACTION = "inference/episode_env_token_fraction"
INFERENCE_EPISODE_TRUNCATED = "inference/episode_truncated"
INFERENCE_EPISODE_HIT_MAX_TURNS = "inference/episode_hit_max_turns"
INFERENCE_EPISODE_SPLIT_TRACES = "inference/episode_split_traces"
INFERENCE_AGENT_SPLITS = "inference/agent_splits"
INFERENCE_AGENT_OVERRIDDEN_SAMPLING = "inference/agent_overridden_sampling"
INFERENCE_AGENT_ERRORS_KIND_TEMPLATE = "inference/agent_errors_{kind}"
INFERENCE_EPISODES_DROPPED = "inference/episodes_dropped"
INFERENCE_EPISODES_DROPPED_TOTAL = "inference/episodes_dropped_total"
INFERENCE_EPISODES_FAILED_SCORED = "inference/episodes_failed_scored"
INFERENCE_TOOL_CALLS_PER_EPISODE = "inference/tool_calls_per_episode"
INFERENCE_TOOL_ERRORS = "inference/tool_errors"
INFERENCE_TOOL_TIMEOUTS = "inference/tool_timeouts"
INFERENCE_TOOL_QUEUE_WAIT_MEAN = "inference/tool_queue_wait_mean (s)"
INFERENCE_TOOL_QUEUE_WAIT_MAX = "inference/tool_queue_wait_max (s)"
INFERENCE_TOOL_ERRORS_KIND_TEMPLATE = "inference/tool_errors_{kind}"
INFERENCE_ENV_METRIC_TEMPLATE = "inference/env_{name}"

EVAL_ACCURACY = "eval/accuracy"
EVAL_NUM_EXAMPLES = "eval/num_examples"
EVAL_SAMPLES_PER_EXAMPLE = "eval/samples_per_example"
EVAL_RESPONSE_TOKENS_MEAN = "eval/response_tokens_mean"
EVAL_FAILED_EPISODES = "eval/failed_episodes"
EVAL_TIME = "eval/time (s)"
EVAL_AVG_AT_K_TEMPLATE = "eval/avg@{k}"
EVAL_PASS_AT_K_TEMPLATE = "eval/pass@{k}"
EVAL_TASK_AVG_AT_K_TEMPLATE = "eval/task_{task}/avg@{k}"
EVAL_TASK_PASS_AT_K_TEMPLATE = "eval/task_{task}/pass@{k}"
EVAL_REWARD_MEAN_TEMPLATE = "eval/reward_{name}_mean"
EVAL_SUCCESS_MEAN_TEMPLATE = "eval/success_{name}_mean"

FAULTS_ACTOR_RESTARTS = "faults/actor_restarts"
FAULTS_STEPS_REDONE = "faults/steps_redone"

# Checked in order: exact names before the globs that would claim them (the `queues/` keys
# come from different actors).
STEP_METRIC_RULES: tuple[tuple[str, str], ...] = (
    ("queues/replay_buffer_*", TRAINING_STEP),
    (ROLLOUT_QUEUE_SIZE, REF_STEP),
    ("training/*", TRAINING_STEP),
    ("training_*", TRAINING_STEP),
    ("ref_*", REF_STEP),
    ("inference/*", INFERENCE_STEP),
    ("eval/*", TRAINING_STEP),
    ("faults/*", TRAINING_STEP),
)

# The ``actor`` argument of `MetricLogger.log_dict` -> the step metric of keys no rule covers.
ACTOR_STEP_METRIC: dict[str, str] = {
    "training": TRAINING_STEP,
    "ref": REF_STEP,
    "inference": INFERENCE_STEP,
    "eval": TRAINING_STEP,
}

# The names other code relies on; actors may log more. ``{name}``: a reward function's name.
METRIC_NAMES: dict[str, tuple[str, ...]] = {
    # PyTorchActorModel, keyed on the optimizer step (`training_step`).
    "training": (
        TRAIN_LOSS,
        "training/policy_loss",
        TRAIN_KL_LOSS,
        "training/ratios",
        "training/clipfrac",
        TRAIN_APPROX_POLICY_KLS,
        "training/kl_to_ref",
        "training/mismatch_kl",
        TRAIN_MISMATCH_MAX_ABS,
        TRAIN_CORRECTION_MASKED_FRACTION,
        TRAIN_CORRECTION_MASKED_SEQUENCE_FRACTION,
        TRAIN_RESPONSE_LENGTHS,
        TRAIN_POLICY_AGE_MEAN,
        TRAIN_POLICY_AGE_MAX,
        TRAIN_GRAD_NORM,
        TRAIN_LR,
        TRAIN_PERF_TOTAL_STEP_TIME,
        TRAIN_PERF_TIME_GRPO_STEPS,
        "training_perf/pct_time_grpo_steps (%)",
        TRAIN_PERF_TOKENS_PER_SECOND,
        TRAIN_PERF_TIME_WEIGHT_SYNC,
        "training_perf/pct_time_weight_sync (%)",
        TRAIN_PERF_PADDED_TOKENS_PERCENTAGE,
        TRAIN_PERF_SHARED_PROMPT_TOKENS_SAVED,
        TRAIN_PERF_TIME_WAITING_BUFFER,
        "training_perf/pct_time_waiting_buffer (%)",
        TRAIN_PERF_TIME_WEIGHT_GATHER,
        "training_perf/pct_time_weight_gather (%)",
        TRAIN_PERF_STEP_WALL_TIME,
        TRAIN_PERF_TIME_TRAIN_COMPUTE,
        TRAIN_PERF_TIME_WEIGHT_TRANSFER,
        TRAIN_PERF_TIME_ENGINE_RELOAD,
        TRAIN_PERF_TIME_DRIVER_OVERHEAD,
        TRAIN_PERF_TIME_GENERATION_BUSY,
        TRAIN_PERF_TIME_SCORING_BUSY,
        REPLAY_BUFFER_SIZE,
        REPLAY_BUFFER_DROPPED_STALE,
    ),
    # RefActor, keyed on its own step (`ref_step`).
    "ref": (
        REF_PERF_TOTAL_ROLLOUT_TIME,
        REF_PERF_TIME_MODEL_RUNNING,
        REF_PERF_PCT_TIME_MODEL_RUNNING,
        REF_PERF_TIME_WAITING_BUFFER,
        "ref_perf/pct_time_waiting_buffer (%)",
        REF_PERF_TOTAL_TOKENS_PROCESSED,
        REF_PERF_SHARED_PROMPT_TOKENS_SAVED,
        ROLLOUT_QUEUE_SIZE,
        REWARDS_MEAN,
        SUCCESSES_MEAN,
        REWARDS_FUNC_MEAN_TEMPLATE,
        SUCCESSES_FUNC_MEAN_TEMPLATE,
        REF_TEACHER_REVERSE_KL,
        # Counted by the driver, once per training step.
        GROUPS_SCORED,
        GROUPS_KEPT,
        ZERO_VARIANCE_GROUPS,
    ),
    # SyncLLMCollector (vLLM), keyed on its generation round (`inference_step`).
    "inference": (
        INFERENCE_TOKENS_PER_SECOND,
        INFERENCE_TIME_GENERATION,
        INFERENCE_TIME_WEIGHT_UPDATE,
        INFERENCE_POLICY_VERSION,
        INFERENCE_RESPONSE_LENGTH_MEAN,
        INFERENCE_WEIGHT_UPDATES_IN_FLIGHT,
        INFERENCE_TIME_ENGINE_PAUSED,
        INFERENCE_WEIGHT_UPDATES_REJECTED,
        INFERENCE_TRAJECTORIES_SPANNING_VERSIONS,
        INFERENCE_TOKENS_VERSION_LAG_0,
        INFERENCE_TOKENS_VERSION_LAG_1,
        INFERENCE_TOKENS_VERSION_LAG_2_PLUS,
        # Logged by the driver when the engine next sleeps, for the sleep and wake before it.
        INFERENCE_TIME_ASLEEP,
        INFERENCE_TIME_TO_WAKE,
        INFERENCE_EPISODE_TURNS_MEAN,
        INFERENCE_EPISODE_TURN_LENGTH_MEAN,
        INFERENCE_EPISODE_ENV_TOKEN_FRACTION,
        INFERENCE_EPISODE_TRUNCATED,
        INFERENCE_EPISODES_DROPPED,
        INFERENCE_EPISODES_FAILED_SCORED,
        INFERENCE_TOOL_CALLS_PER_EPISODE,
        INFERENCE_TOOL_ERRORS,
        INFERENCE_TOOL_TIMEOUTS,
        INFERENCE_TOOL_QUEUE_WAIT_MEAN,
        INFERENCE_TOOL_QUEUE_WAIT_MAX,
    ),
    # Held-out evaluation, keyed on the train step whose weights were evaluated.
    "eval": (
        EVAL_ACCURACY,
        EVAL_NUM_EXAMPLES,
    ),
}

# Keys a metric may not use: they are the JSONL record's own fields.
RESERVED_KEYS = frozenset({"step", "time", "actor"})


def reward_metric_names(func_name: str) -> tuple[str, str]:
    """The per-function reward and success metric names of a reward function.

    Returns:
        tuple[str, str]: ``(rewards key, successes key)``.
    """
    return (
        REWARDS_FUNC_MEAN_TEMPLATE.format(name=func_name),
        SUCCESSES_FUNC_MEAN_TEMPLATE.format(name=func_name),
    )


def is_known_metric(key: str) -> bool:
    """Whether `key` is one of `METRIC_NAMES` (templates match any function name)."""
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
        actor: The actor that logged it (a key of `ACTOR_STEP_METRIC`); decides for keys
            that no rule of `STEP_METRIC_RULES` covers.

    Returns:
        str: ``"training_step"``, ``"ref_step"``, ``"inference_step"`` or ``"global_step"``.
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

    Args:
        durations: Seconds per timing, keyed by name, with or without the namespace and the
            ``" (s)"`` suffix.
        total: Seconds of the whole step; 0 gives 0 %.
    """
    metrics = {}
    for name, seconds in durations.items():
        name = name.removeprefix(f"{prefix}/").removesuffix(" (s)")
        # `total > 0` is False for NaN as well, so a broken timer reads 0 % rather than NaN.
        metrics[f"{prefix}/pct_{name} (%)"] = 100.0 * seconds / total if total > 0 else 0.0
    return metrics
