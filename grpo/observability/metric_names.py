"""The metric names: the contract between the actors, the logger, the plots and the tests.

One constant per metric name that more than one module uses (``TRAIN_LOSS``,
``EVAL_ACCURACY``, ...), which names each actor logs (`METRIC_NAMES`), which step metric each
name is plotted against on W&B (`STEP_METRIC_RULES`, `step_metric_for`), the
per-reward-function names (`reward_metric_names`), and the one place for the percent-of-total
arithmetic of the performance metrics (`ratio_metrics`). Pure Python: the driver, the actors
and the plots import it without the logger.
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

# The metric names that more than one module uses, one constant each, grouped by namespace: any
# other module names them through these (a test finds the literals), so that a renamed metric
# cannot leave a reader behind. A constant is the name in upper case, after its namespace's short
# form (``TRAIN_``, ``TRAIN_PERF_``, ``REF_PERF_``, ``INFERENCE_``, ``EVAL_``, ``FAULTS_``); the
# ``ref_actor_rewards/`` and ``queues/`` names say what they count without one. Unit suffixes
# (`` (s)``, `` (%)``) stay out of the constant's name, never out of its value. A ``*_TEMPLATE``
# is a `str.format` template of a family of names.

# Namespaces that `ratio_metrics` puts its percent-of-total names in.
TRAIN_PERF_NAMESPACE = "train_actor_performance"
REF_PERF_NAMESPACE = "ref_actor_performance"

# train_actor_training/: the trainer's loss terms and batch statistics.
TRAIN_LOSS = "train_actor_training/loss"
TRAIN_KL_LOSS = "train_actor_training/kl_loss"
TRAIN_APPROX_POLICY_KLS = "train_actor_training/approx_policy_kls"
TRAIN_MISMATCH_MAX_ABS = "train_actor_training/mismatch_max_abs"
# training.loss.correction mis or icepop: the share of response tokens whose weight is a mask
# (0), and at correction_level sequence the share of sequences masked whole; 0 otherwise.
TRAIN_CORRECTION_MASKED_FRACTION = "train_actor_training/correction_masked_fraction"
TRAIN_CORRECTION_MASKED_SEQUENCE_FRACTION = (
    "train_actor_training/correction_masked_sequence_fraction"
)
TRAIN_RESPONSE_LENGTHS = "train_actor_training/response_lengths"
TRAIN_POLICY_AGE_MEAN = "train_actor_training/policy_age_mean"
TRAIN_POLICY_AGE_MAX = "train_actor_training/policy_age_max"
TRAIN_GRAD_NORM = "train_actor_training/grad_norm"
TRAIN_LR = "train_actor_training/lr"
# Steps skipped in a row for a non-finite loss or gradient norm; the driver stops the run on it.
TRAIN_NONFINITE_STEPS_IN_A_ROW = "train_actor_training/nonfinite_steps_in_a_row"

# train_actor_performance/: the trainer's timings and throughput.
TRAIN_PERF_TOTAL_STEP_TIME = "train_actor_performance/total_step_time (s)"
TRAIN_PERF_TIME_GRPO_STEPS = "train_actor_performance/time_grpo_steps (s)"
TRAIN_PERF_TOKENS_PER_SECOND = "train_actor_performance/tokens_per_second"
TRAIN_PERF_TIME_WEIGHT_SYNC = "train_actor_performance/time_weight_sync (s)"
TRAIN_PERF_PADDED_TOKENS_PERCENTAGE = "train_actor_performance/padded_tokens_percentage (%)"
TRAIN_PERF_SHARED_PROMPT_TOKENS_SAVED = "train_actor_performance/shared_prompt_tokens_saved (%)"
# The step's wall time and its parts (`grpo.observability.metrics.step_time_breakdown`).
TRAIN_PERF_STEP_WALL_TIME = "train_actor_performance/step_wall_time (s)"
TRAIN_PERF_TIME_WAITING_BUFFER = "train_actor_performance/time_waiting_buffer (s)"
TRAIN_PERF_TIME_TRAIN_COMPUTE = "train_actor_performance/time_train_compute (s)"
TRAIN_PERF_TIME_WEIGHT_GATHER = "train_actor_performance/time_weight_gather (s)"
TRAIN_PERF_TIME_WEIGHT_TRANSFER = "train_actor_performance/time_weight_transfer (s)"
TRAIN_PERF_TIME_ENGINE_RELOAD = "train_actor_performance/time_engine_reload (s)"
TRAIN_PERF_TIME_DRIVER_OVERHEAD = "train_actor_performance/time_driver_overhead (s)"
TRAIN_PERF_TIME_GENERATION_BUSY = "train_actor_performance/time_generation_busy (s)"
TRAIN_PERF_TIME_SCORING_BUSY = "train_actor_performance/time_scoring_busy (s)"

# ref_actor_performance/: the reference actor's timings.
REF_PERF_TOTAL_ROLLOUT_TIME = "ref_actor_performance/total_rollout_time (s)"
REF_PERF_TIME_MODEL_RUNNING = "ref_actor_performance/time_model_running (s)"
REF_PERF_PCT_TIME_MODEL_RUNNING = "ref_actor_performance/pct_time_model_running (%)"
REF_PERF_TIME_WAITING_BUFFER = "ref_actor_performance/time_waiting_buffer (s)"
REF_PERF_TOTAL_TOKENS_PROCESSED = "ref_actor_performance/total_tokens_processed"
REF_PERF_SHARED_PROMPT_TOKENS_SAVED = "ref_actor_performance/shared_prompt_tokens_saved (%)"

# ref_actor_rewards/: rewards of the scored batch (`reward_metric_names` fills the templates).
REWARDS_MEAN = "ref_actor_rewards/rewards_mean"
SUCCESSES_MEAN = "ref_actor_rewards/successes_mean"
REWARDS_FUNC_MEAN_TEMPLATE = "ref_actor_rewards/rewards_func_{name}_mean"
SUCCESSES_FUNC_MEAN_TEMPLATE = "ref_actor_rewards/successes_func_{name}_mean"
# Per-step group counts of dynamic sampling (`grpo.orchestrator.group_counts.GroupCounts`).
GROUPS_SCORED = "ref_actor_rewards/groups_scored"
GROUPS_KEPT = "ref_actor_rewards/groups_kept"
ZERO_VARIANCE_GROUPS = "ref_actor_rewards/zero_variance_groups"

# ref_actor_distillation/: on-policy distillation (ref.teacher_model_path). The scored batch's
# mean over policy tokens of behaviour - teacher logprob: the sampled estimate of the reverse
# KL to the teacher per token.
REF_TEACHER_REVERSE_KL = "ref_actor_distillation/teacher_reverse_kl"

# queues/: the rollout queue and the replay buffer, each logged by the actor it feeds.
TRAIN_REPLAY_BUFFER_SIZE = "queues/train_replay_buffer_size"
REPLAY_BUFFER_DROPPED_STALE = "queues/replay_buffer_dropped_stale"
ROLLOUT_QUEUE_SIZE = "queues/rollout_queue_size"
ROLLOUT_QUEUE_PUT_WAIT_S = "queues/rollout_queue_put_wait_s"

# inference/: the collectors' generation rounds.
INFERENCE_TOKENS_PER_SECOND = "inference/tokens_per_second"
INFERENCE_GENERATED_TOKENS = "inference/generated_tokens"
INFERENCE_TIME_GENERATION = "inference/time_generation (s)"
INFERENCE_TIME_WEIGHT_UPDATE = "inference/time_weight_update (s)"
INFERENCE_POLICY_VERSION = "inference/policy_version"
INFERENCE_RESPONSE_LENGTH_MEAN = "inference/response_length_mean"
# Non-zero when the collector found the rollout queue dead and kept its groups.
INFERENCE_GROUPS_NOT_QUEUED = "inference/groups_not_queued"
# Weight updates while generating (inference.weight_updates: in_flight).
INFERENCE_WEIGHT_UPDATES_IN_FLIGHT = "inference/weight_updates_in_flight"
INFERENCE_TIME_ENGINE_PAUSED = "inference/time_engine_paused (s)"
INFERENCE_WEIGHT_UPDATES_REJECTED = "inference/weight_updates_rejected"
INFERENCE_TRAJECTORIES_SPANNING_VERSIONS = "inference/trajectories_spanning_versions"
INFERENCE_TOKENS_VERSION_LAG_0 = "inference/tokens_version_lag_0"
INFERENCE_TOKENS_VERSION_LAG_1 = "inference/tokens_version_lag_1"
INFERENCE_TOKENS_VERSION_LAG_2_PLUS = "inference/tokens_version_lag_2+"
# inference.sleep_while_training (`grpo.workers.engine_sleep`): how long the engine slept while
# the trainer stepped, and how long its wake took (weights, load, KV cache, probe).
INFERENCE_TIME_ASLEEP = "inference/time_asleep (s)"
INFERENCE_TIME_TO_WAKE = "inference/time_to_wake (s)"
# Multi-turn environments (`grpo.envs`), per batch of episodes.
INFERENCE_EPISODE_TURNS_MEAN = "inference/episode_turns_mean"
INFERENCE_EPISODE_TURNS_MAX = "inference/episode_turns_max"
INFERENCE_EPISODE_TURN_LENGTH_MEAN = "inference/episode_turn_length_mean"
INFERENCE_EPISODE_ENV_TOKEN_FRACTION = "inference/episode_env_token_fraction"
INFERENCE_EPISODE_TRUNCATED = "inference/episode_truncated"
INFERENCE_EPISODE_HIT_MAX_TURNS = "inference/episode_hit_max_turns"
INFERENCE_EPISODE_SPLIT_TRACES = "inference/episode_split_traces"
# Agents as environments (`grpo.envs.AgentEnv`): episodes split by a rewritten history, calls
# whose own sampling was answered with the run's, and agent errors by kind, per batch.
INFERENCE_AGENT_SPLITS = "inference/agent_splits"
INFERENCE_AGENT_OVERRIDDEN_SAMPLING = "inference/agent_overridden_sampling"
INFERENCE_AGENT_ERRORS_KIND_TEMPLATE = "inference/agent_errors_{kind}"
INFERENCE_EPISODES_DROPPED = "inference/episodes_dropped"
INFERENCE_EPISODES_DROPPED_TOTAL = "inference/episodes_dropped_total"
# Episodes the environment failed that stayed in their groups with the failure rewards
# (an environment's ``failed_episodes: score``), per batch.
INFERENCE_EPISODES_FAILED_SCORED = "inference/episodes_failed_scored"
INFERENCE_TOOL_CALLS_PER_EPISODE = "inference/tool_calls_per_episode"
INFERENCE_TOOL_ERRORS = "inference/tool_errors"
INFERENCE_TOOL_TIMEOUTS = "inference/tool_timeouts"
INFERENCE_TOOL_QUEUE_WAIT_MEAN = "inference/tool_queue_wait_mean (s)"
INFERENCE_TOOL_QUEUE_WAIT_MAX = "inference/tool_queue_wait_max (s)"
# Tool errors of one kind (``timeout``, ...), and an environment's own metric by its name.
INFERENCE_TOOL_ERRORS_KIND_TEMPLATE = "inference/tool_errors_{kind}"
INFERENCE_ENV_METRIC_TEMPLATE = "inference/env_{name}"

# eval/: held-out evaluation.
EVAL_ACCURACY = "eval/accuracy"
EVAL_NUM_EXAMPLES = "eval/num_examples"
EVAL_SAMPLES_PER_EXAMPLE = "eval/samples_per_example"
EVAL_RESPONSE_TOKENS_MEAN = "eval/response_tokens_mean"
EVAL_FAILED_EPISODES = "eval/failed_episodes"
EVAL_TIME = "eval/time (s)"
# avg@k and pass@k of the first reward function's success (k: samples per example), overall
# and per task (an example's ``task`` column); each reward function's mean and success rate.
EVAL_AVG_AT_K_TEMPLATE = "eval/avg@{k}"
EVAL_PASS_AT_K_TEMPLATE = "eval/pass@{k}"
EVAL_TASK_AVG_AT_K_TEMPLATE = "eval/task_{task}/avg@{k}"
EVAL_TASK_PASS_AT_K_TEMPLATE = "eval/task_{task}/pass@{k}"
EVAL_REWARD_MEAN_TEMPLATE = "eval/reward_{name}_mean"
EVAL_SUCCESS_MEAN_TEMPLATE = "eval/success_{name}_mean"

# faults/: restarts and the work they cost (the supervisor and the training loop).
FAULTS_ACTOR_RESTARTS = "faults/actor_restarts"
FAULTS_STEPS_REDONE = "faults/steps_redone"

# (W&B metric name or glob, step metric), checked in order: exact names before the namespace
# globs that would otherwise claim them. The `queues/` keys come from different actors, so each
# one is routed to the actor that logs it.
STEP_METRIC_RULES: tuple[tuple[str, str], ...] = (
    (TRAIN_REPLAY_BUFFER_SIZE, TRAIN_STEP),
    ("queues/replay_buffer_*", TRAIN_STEP),
    (ROLLOUT_QUEUE_SIZE, REF_STEP),
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
        TRAIN_LOSS,
        "train_actor_training/policy_loss",
        TRAIN_KL_LOSS,
        "train_actor_training/ratios",
        "train_actor_training/clipfrac",
        TRAIN_APPROX_POLICY_KLS,
        # Token mean of the KL estimate to the reference model (the loss's estimator), logged
        # whether or not the KL term is in the loss (kl_coeff 0).
        "train_actor_training/kl_to_ref",
        # Sampler (vLLM) vs trainer logprobs of the same pre-update policy: token mean of the
        # k3 estimate of KL(behaviour || pi_old), and the largest |pi_old - behaviour|.
        "train_actor_training/mismatch_kl",
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
        "train_actor_performance/pct_time_grpo_steps (%)",
        TRAIN_PERF_TOKENS_PER_SECOND,
        TRAIN_PERF_TIME_WEIGHT_SYNC,
        "train_actor_performance/pct_time_weight_sync (%)",
        TRAIN_PERF_PADDED_TOKENS_PERCENTAGE,
        TRAIN_PERF_SHARED_PROMPT_TOKENS_SAVED,
        TRAIN_PERF_TIME_WAITING_BUFFER,
        "train_actor_performance/pct_time_waiting_buffer (%)",
        TRAIN_PERF_TIME_WEIGHT_GATHER,
        "train_actor_performance/pct_time_weight_gather (%)",
        # The step's wall time and the parts that add up to it (`step_time_breakdown` in
        # grpo.observability.metrics explains each): time_waiting_buffer, time_train_compute,
        # time_weight_gather, time_weight_transfer, time_engine_reload, time_driver_overhead.
        TRAIN_PERF_STEP_WALL_TIME,
        TRAIN_PERF_TIME_TRAIN_COMPUTE,
        TRAIN_PERF_TIME_WEIGHT_TRANSFER,
        TRAIN_PERF_TIME_ENGINE_RELOAD,
        TRAIN_PERF_TIME_DRIVER_OVERHEAD,
        # Busy seconds of generation and scoring calls that finished during the step, summed
        # over actors; they overlap training and are not parts of the wall time.
        TRAIN_PERF_TIME_GENERATION_BUSY,
        TRAIN_PERF_TIME_SCORING_BUSY,
        TRAIN_REPLAY_BUFFER_SIZE,
        REPLAY_BUFFER_DROPPED_STALE,
    ),
    # RefActor, keyed on its own step (`ref_step`).
    "ref": (
        REF_PERF_TOTAL_ROLLOUT_TIME,
        REF_PERF_TIME_MODEL_RUNNING,
        REF_PERF_PCT_TIME_MODEL_RUNNING,
        REF_PERF_TIME_WAITING_BUFFER,
        "ref_actor_performance/pct_time_waiting_buffer (%)",
        REF_PERF_TOTAL_TOKENS_PROCESSED,
        REF_PERF_SHARED_PROMPT_TOKENS_SAVED,
        ROLLOUT_QUEUE_SIZE,
        REWARDS_MEAN,
        SUCCESSES_MEAN,
        REWARDS_FUNC_MEAN_TEMPLATE,
        SUCCESSES_FUNC_MEAN_TEMPLATE,
        REF_TEACHER_REVERSE_KL,
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
        INFERENCE_TOKENS_PER_SECOND,
        INFERENCE_TIME_GENERATION,
        INFERENCE_TIME_WEIGHT_UPDATE,
        INFERENCE_POLICY_VERSION,
        INFERENCE_RESPONSE_LENGTH_MEAN,
        # Weights loaded while the batch generated (inference.weight_updates: in_flight), the
        # time generation paused for them, and the sampled tokens by how many versions their
        # weights were behind the collector's at the end of the batch.
        INFERENCE_WEIGHT_UPDATES_IN_FLIGHT,
        INFERENCE_TIME_ENGINE_PAUSED,
        INFERENCE_WEIGHT_UPDATES_REJECTED,
        INFERENCE_TRAJECTORIES_SPANNING_VERSIONS,
        INFERENCE_TOKENS_VERSION_LAG_0,
        INFERENCE_TOKENS_VERSION_LAG_1,
        INFERENCE_TOKENS_VERSION_LAG_2_PLUS,
        # inference.sleep_while_training only: logged by the driver when the engine next
        # sleeps, for the sleep and wake before it.
        INFERENCE_TIME_ASLEEP,
        INFERENCE_TIME_TO_WAKE,
        # Multi-turn environments only (`grpo.envs`): per batch of episodes.
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

    Args:
        func_name (str): The reward function's name, as in ``reward_metadata["func_names"]``.

    Returns:
        tuple[str, str]: ``(rewards key, successes key)``.

    Example:
        >>> reward_metric_names("math_correct")
        ('ref_actor_rewards/rewards_func_math_correct_mean', 'ref_actor_rewards/successes_func_math_correct_mean')
    """
    return (
        REWARDS_FUNC_MEAN_TEMPLATE.format(name=func_name),
        SUCCESSES_FUNC_MEAN_TEMPLATE.format(name=func_name),
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
        prefix (str): Metric namespace, e.g. ``"train_actor_performance"``
            (`TRAIN_PERF_NAMESPACE`).
        durations (Mapping[str, float]): Seconds per timing, keyed by name (``"time_x"``,
            ``"time_x (s)"``, or the metric's full name ``"{prefix}/time_x (s)"``; the
            namespace and the ``" (s)"`` suffix are dropped).
        total (float): Seconds of the whole step.

    Returns:
        dict[str, float]: ``{f"{prefix}/pct_{name} (%)": 100 * seconds / total}``.

    Example:
        >>> ratio_metrics("ref_actor_performance", {"time_model_running": 1.5}, total=2.0)
        {'ref_actor_performance/pct_time_model_running (%)': 75.0}
    """
    metrics = {}
    for name, seconds in durations.items():
        name = name.removeprefix(f"{prefix}/").removesuffix(" (s)")
        # `total > 0` is False for NaN as well, so a broken timer reads 0 % rather than NaN.
        metrics[f"{prefix}/pct_{name} (%)"] = 100.0 * seconds / total if total > 0 else 0.0
    return metrics
