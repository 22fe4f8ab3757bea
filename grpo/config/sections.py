"""The sections of a run config, one per component that reads them.

Each section is the config of one component, which imports it from here (the collector takes an
`InferenceConfig`, the reference actor a `RefConfig`, ...); nothing here imports a component.
An option lives in the section of the component that reads it. Imports: pydantic and typing.
"""

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator

from grpo.choices import (
    Aggregation,
    Correction,
    DType,
    KLEstimator,
    Level,
    LoRATarget,
    MaskKind,
    WandbMode,
    WeightTransportKind,
    WeightUpdateMode,
)
from grpo.config.schema import COMPONENT_DEFAULT, Component, ComponentArgs, Section


def _custom_resource_names(resources: dict[str, float]) -> dict[str, float]:
    for name in resources:
        if name in ("CPU", "GPU", "memory", "object_store_memory"):
            raise ValueError(f"{name!r} is set by num_cpus / num_gpus, not as a custom resource")
    return resources


# vLLM raises a lower sampling temperature to this one (``vllm.sampling_params._MAX_TEMP``).
MIN_TEMPERATURE = 0.01

ActorResources = Annotated[
    dict[str, Annotated[float, Field(ge=0)]], AfterValidator(_custom_resource_names)
]
"""Ray custom resources of one actor: it starts only on a node that has them."""

RewardTimeout = Annotated[float, Field(gt=0)]
"""Seconds one reward call may take before it scores 0: the run's ``reward_timeout_s``, and
the keyword of every environment that scores with reward functions."""
REWARD_TIMEOUT_S = 10.0
"""Its default, for the run config and every environment alike."""

# Options that a component checks as the config does: one declaration for both.
BufferCapacity = Annotated[int, Field(ge=1)]
"""Trajectories the replay buffer holds: ``orchestration.replay_buffer_size``."""
PolicyLag = Annotated[int, Field(ge=0)]
"""Training steps a trajectory may lag: ``orchestration.max_policy_lag``."""
StdoutEveryN = Annotated[int, Field(ge=0)]
"""Print every n-th step of each actor to stdout (0: nothing): ``metric_logger.stdout_every_n``."""

# --------------------------------------------------------------------------------------------
# ray: and orchestration: (the driver)
# --------------------------------------------------------------------------------------------


class RayConfig(Section):
    """Ray cluster."""

    address: str | None = None
    """null: start a local cluster; 'auto' or 'ray://HOST:PORT': join one."""
    num_cpus: float | None = Field(None, ge=0)
    """CPU slots of a local cluster (logical, may exceed the cores); null: the machine's core
    count."""
    num_gpus: float | None = Field(None, ge=0)
    """GPUs of a local cluster; null: all visible GPUs."""

    @field_validator("address")
    @classmethod
    def _known_address_form(cls, value: str | None) -> str | None:
        if value is None or value == "auto" or value.startswith("ray://"):
            return value
        if re.fullmatch(r"[\w.\-]+:\d+", value):
            return value
        raise ValueError(
            "must be null (start a local cluster), 'auto', 'ray://HOST:PORT' or 'HOST:PORT'; "
            f"got {value!r}"
        )


class OrchestrationConfig(Section):
    """Actors and the run length."""

    num_steps: int = Field(ge=1)
    """Optimizer steps to train for."""
    synchronous: bool = False
    """true: generate, score and train in lock-step (on-policy, reproducible to the bit; for
    debugging and exact-resume checks); false: overlap them."""
    num_inference_workers: int = Field(1, ge=1)
    """vLLM collector actors, each with its own dataset shard."""
    num_ref_workers: int = Field(1, ge=1)
    """Reference-model actors (ref logprobs and group advantages)."""
    num_training_workers: int = Field(1, ge=1)
    """Training actors; more than one shards the model with FSDP2."""
    replay_buffer_size: BufferCapacity = 512
    """Most trajectories the replay buffer holds; when it is full, scored groups wait for room
    (nothing is dropped)."""
    max_policy_lag: PolicyLag = 1
    """Staleness bound, in training steps: a trajectory is dropped, and counted, when its
    oldest token was sampled by weights more than this many steps older than those the trainer
    is about to update (0: strictly on-policy, every batch sampled by the current weights;
    needs weight_sync.every_n_steps 1). Before each sync the collectors' newest weights are up
    to every_n_steps - 1 steps old, so grpo validate refuses a bound below that."""
    stall_timeout_s: float = Field(600.0, gt=0)
    """With no training step for this many seconds, replace the actor that holds the run up (a
    frozen or hung collector, a trainer stuck in a step, an actor stuck in one call), or stop
    naming it when replacing cannot help (every sample dropped as stale)."""
    equal_rewards_timeout_s: float = Field(120.0, gt=0)
    """With ref.filter_zero_variance_groups, stop when every group scored while waiting this
    long for a batch had equal rewards (nothing to train on: a task the model cannot yet score
    on, or one it has solved); a warning comes after a quarter of it. The reward distribution
    of the first 64 episodes is logged, and warned about when every group was equal."""
    max_actor_restarts: int = Field(3, ge=0)
    """Times each collector, reference actor and the replay buffer may be restarted after dying
    (their work is rebuilt, nothing is lost); one more death stops the run with a checkpoint.
    The trainers, together, may die this many times too: each time the run restarts from its
    latest checkpoint and redoes the steps after it."""
    max_nonfinite_steps_in_a_row: int = Field(3, ge=1)
    """A step whose loss or gradient norm is not finite is skipped (weights and optimizer
    untouched) and counted; this many in a row stop the run with a checkpoint."""


class CheckpointConfig(Section):
    """Checkpoints."""

    save_every_n_steps: int | None = Field(None, ge=1)
    """Checkpoint every N steps; null: by time only (save_every_n_minutes). A run always saves
    one at its end."""
    save_every_n_minutes: float | None = Field(30.0, gt=0)
    """Checkpoint at the first step boundary after this many minutes since the last one (or
    the start); null: by steps only. A dead trainer costs the steps since the last one."""


# --------------------------------------------------------------------------------------------
# inference: (SyncLLMCollector)
# --------------------------------------------------------------------------------------------


class InferenceConfig(Section):
    """Generation (vLLM collectors)."""

    batch_size: int = Field(8, ge=1)
    """Prompts per generation batch (each sampled group_size times)."""
    group_size: int = Field(8, ge=2)
    """Responses per prompt; advantages are normalised within a group, so at least 2."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """Longest prompt in tokens (longer ones are skipped); null: engine_args.max_model_len
    (default: the model's max_position_embeddings) minus the longest response
    (max_generated_tokens, or an environment's max_episode_tokens when larger)."""
    max_generated_tokens: int = Field(256, ge=1)
    """Most tokens generated per response."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature, at least 0.01. The behaviour logprobs are those of the tempered
    distribution (vLLM's processed_logprobs), and the trainer and reference divide their logits
    by it too; vLLM samples with 0.01 when given less, so a lower value is refused."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass; only 1.0 trains (grpo validate refuses less): the trainer's
    logprobs cannot reproduce the nucleus, so the importance ratio would compare against a
    distribution that did not sample the tokens. Lower temperature to sample more sharply."""
    weight_updates: WeightUpdateMode = "in_flight"
    """in_flight: new weights are loaded between two decode steps of the running batch, whose
    sequences are prefilled again with them and go on, every later token the new policy's (a
    trajectory records the oldest and newest version of its tokens); in_flight_keep_kv: the
    same without the second prefill, the running sequences attend to keys and values the old
    weights computed (cheaper where prefill is slow, as on CPU; the behaviour logprobs are
    still the sampled ones); between_batches: only before a generation batch."""
    weight_check_every_n_batches: int = Field(1, ge=1)
    """Generation batches between checks for new weights (between_batches updates)."""
    queue_maxsize: int = Field(64, ge=1)
    """Capacity of the rollout queue, in groups."""
    queue_put_timeout_s: float = Field(1.0, gt=0)
    """Timeout in seconds of one put onto a full rollout queue."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed through to vllm.LLM (enforce_eager, dtype, max_model_len,
    gpu_memory_utilization, ...)."""
    num_gpus: float = Field(0, ge=0)
    """GPUs per collector actor."""
    num_cpus: float = Field(1, ge=0)
    """CPUs per collector actor."""
    sleep_while_training: bool = False
    """Time-share one GPU with the trainer (needs orchestration.synchronous): vLLM sleeps
    while the trainer steps and wakes for generation; level 1 (weights kept in CPU memory)
    with training.lora, level 2 (weights dropped, the new ones loaded on wake) otherwise.
    Every wake is followed by the weight probe."""
    resources: ActorResources = Field(default_factory=dict)
    """Ray custom resources per collector actor, e.g. {rollout_node: 1}: they start only on
    nodes that have them (``ray start --resources='{"rollout_node": 4}'``), which places the
    role on chosen nodes of a cluster. A resource no node has is refused at start."""

    @field_validator("temperature")
    @classmethod
    def _temperature_the_engine_samples_with(cls, value: float) -> float:
        if value < MIN_TEMPERATURE:
            raise ValueError(
                f"{value!r} is below {MIN_TEMPERATURE}, the lowest temperature vLLM samples "
                f"with (it raises a lower one to {MIN_TEMPERATURE}), while the trainer and the "
                "reference would divide their logits by the value given: the importance ratio "
                f"would compare two different distributions; use {MIN_TEMPERATURE} or more"
            )
        return value


# --------------------------------------------------------------------------------------------
# ref: (RefActor)
# --------------------------------------------------------------------------------------------


class RefConfig(Section):
    """Reference model, rewards and advantages."""

    filter_zero_variance_groups: bool = False
    """Dynamic sampling: drop groups whose rewards are all equal (zero advantages) before the
    replay buffer, and generate more until a batch of training.batch_size informative
    trajectories is there (the extra generation shows in ref_rewards/groups_scored)."""
    reward_weights: dict[str, float] | None = None
    """Weight of each reward in the total reward, by reward name (a reward function's name, or
    a name in an environment's scores), e.g. {math_correctness: 1.0, format: 0.2}; a reward
    not named weighs 1. null: all 1."""
    advantage_std_normalization: bool = True
    """true: a sample's advantage is (r - group mean) / (group std + 1e-4) (GRPO); false: r -
    group mean, undivided (Dr. GRPO, together with training.loss.aggregation:
    seq_mean_token_sum_norm): dividing by the std weighs groups that nearly agree (too easy or
    too hard) more."""
    dtype: DType = "fp32"
    """Reference model dtype."""
    mask_kind: MaskKind = "auto"
    """Attention of reference and teacher packs: auto (flex on CUDA, varlen elsewhere), dense,
    varlen (fastest on CPU) or flex (FlexAttention BlockMask; best on CUDA)."""
    teacher_model_path: str | None = None
    """On-policy distillation: a Hugging Face model folder whose tokenizer is the policy's
    (same vocabulary, special tokens and eos; grpo validate compares them). The reference
    actor loads it and scores the tokens the policy sampled, and each response token's
    advantage gets distillation_coeff * (teacher logprob - behaviour logprob), both at the
    sampling temperature: the reverse KL to the teacher as a per-token reward
    (docs/training.md). Relative: current directory first, then the repo root. null: no
    teacher."""
    teacher_dtype: DType = "fp32"
    """Teacher model dtype."""
    distillation_coeff: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Weight of the teacher signal in each token's advantage."""
    distillation_only: bool = False
    """true: the advantage is the teacher signal alone (pure on-policy distillation; rewards
    are still computed and logged, and train nothing); false: it is added to the GRPO
    advantage of the episode's rewards."""
    num_gpus: float = Field(0, ge=0)
    """GPUs per reference actor."""
    num_cpus: float = Field(1, ge=0)
    """CPUs per reference actor."""
    resources: ActorResources = Field(default_factory=dict)
    """Ray custom resources per reference actor, e.g. {trainer_node: 1}: they start only on
    nodes that have them (``ray start --resources='{"trainer_node": 4}'``), which places the
    role on chosen nodes of a cluster. A resource no node has is refused at start."""

    @field_validator("teacher_model_path")
    @classmethod
    def _a_folder(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("is empty; give the teacher's model folder, or null for none")
        return value

    @field_validator("teacher_dtype", "distillation_coeff", "distillation_only")
    @classmethod
    def _distillation_needs_a_teacher(cls, value: Any, info: ValidationInfo) -> Any:
        # Defaults are filled into a loaded config, so only a value other than the default
        # can be the user's choice.
        default = cls.model_fields[info.field_name].default
        if value != default and info.data.get("teacher_model_path", "") is None:
            shown = str(value).lower() if isinstance(value, bool) else repr(value)
            raise ValueError(
                f"{shown} configures on-policy distillation, but ref.teacher_model_path is "
                "null: give the teacher's model folder, or remove the setting"
            )
        return value

    @field_validator("distillation_only")
    @classmethod
    def _every_group_carries_the_teacher_signal(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("filter_zero_variance_groups"):
            raise ValueError(
                "true trains on the teacher signal alone, which a group carries whatever its "
                "rewards, but ref.filter_zero_variance_groups drops the groups whose rewards "
                "are all equal, and the signal of their tokens with them; set "
                "ref.filter_zero_variance_groups: false"
            )
        return value

    @field_validator("reward_weights", mode="before")
    @classmethod
    def _weights_by_name(cls, value: Any) -> Any:
        # A list would weigh by position, and the order of an environment's scores is not
        # the order of reward_functions: weights are given by name only.
        if isinstance(value, (list, tuple)):
            raise ValueError(
                f"give the weights by reward name, e.g. {{math_correctness: 1.0, format: 0.2}}, "
                f"not as a list ({list(value)!r})"
            )
        return value


# --------------------------------------------------------------------------------------------
# training: (PyTorchActorModel)
# --------------------------------------------------------------------------------------------


class OptimizerArgs(ComponentArgs):
    """Documented keywords of ``training.optimizer``."""

    lr: float = Field(COMPONENT_DEFAULT, gt=0)
    """Learning rate."""


class LRSchedulerArgs(ComponentArgs):
    """Documented keywords of ``training.lr_scheduler``."""

    num_warmup_steps: int = Field(COMPONENT_DEFAULT, ge=0)
    """Linear warm-up steps."""
    num_cycles: float = Field(COMPONENT_DEFAULT, gt=0)
    """Cosine cycles (0.5: decay to zero once)."""


DEFAULT_LOSS = "grpo.objective.loss.GRPOLoss"
"""The ``_component_`` of ``training.loss`` when a config gives none."""

# (lower, upper) bounds of each mismatch correction where ``correction_low`` /
# ``correction_cap`` are null: those of the method's publication.
CORRECTION_DEFAULT_BOUNDS: dict[str, tuple[float | None, float]] = {
    # TIS: C = 2 (Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL
    # Training", 2025); no lower bound.
    "tis": (None, 2.0),
    # MIS masks above C only (TRL's vllm_importance_sampling_mode *_mask leaves C_min unset;
    # Liu et al., "When Speed Kills Stability", 2025); the same C as TIS (TRL's C_max is 3).
    "mis": (None, 2.0),
    # IcePop's band [alpha, beta] = [0.5, 5] (Ling Team, Ring-1T, arXiv:2510.18855).
    "icepop": (0.5, 5.0),
}


def correction_bounds(
    correction: str, low: float | None, cap: float | None
) -> tuple[float | None, float | None]:
    """The (lower, upper) bounds of a mismatch correction: those set, else its defaults.

    Args:
        correction (str): One of `grpo.choices.CORRECTIONS`.
        low (float | None): ``correction_low`` as set; None for the default.
        cap (float | None): ``correction_cap`` as set; None for the default.

    Returns:
        tuple[float | None, float | None]: The bounds; None where there is none (both for
        ``"none"``, the lower one for TIS and MIS unless set).
    """
    if correction not in CORRECTION_DEFAULT_BOUNDS:
        return None, None
    default_low, default_cap = CORRECTION_DEFAULT_BOUNDS[correction]
    return (default_low if low is None else low), (default_cap if cap is None else cap)


class LossArgs(ComponentArgs):
    """Documented keywords of ``training.loss``, with the defaults of `DEFAULT_LOSS`.

    They are declared here, not read from the loss, because the config itself reads some of
    them when a node leaves them unset (``kl_coeff`` decides whether the reference model is
    loaded, the clip range whether `grpo validate` calls a key idle): `run.loss_defaults`. The
    default loss (`grpo.objective.loss.GRPOLoss`) takes its keyword defaults from here and
    checks its arguments with this model, so it refuses what `grpo validate` refuses; a loss of
    your own has its own defaults, read from its signature.
    """

    epsilon_low: float = Field(0.2, ge=0, lt=1)
    """Lower clip: ratio >= 1 - epsilon_low (below 1: the bound must stay a positive ratio)."""
    epsilon_high: float = Field(0.2, ge=0)
    """Upper clip: ratio <= 1 + epsilon_high."""
    kl_coeff: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Weight of the KL penalty to the reference model. 0: no KL term, and the reference
    actors load no model."""
    kl_estimator: KLEstimator = "k3"
    """Estimator of KL(pi, ref) = E_pi[log pi - log ref] from each sampled token, with r =
    ref / pi: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r. As a loss term what counts
    is its expected gradient: k3's is that of KL(ref, pi) (DeepSeekMath GRPO, verl's
    low_var_kl), k2's that of KL(pi, ref), k1's zero, so k1 is refused beside kl_coeff > 0
    (docs/training.md)."""
    aggregation: Aggregation = "token_mean"
    """token_mean, seq_mean_token_mean, or seq_mean_token_sum_norm (Dr. GRPO's: each
    sequence's token sum over max_response_len; Dr. GRPO also sets
    ref.advantage_std_normalization: false)."""
    max_response_len: int | None = Field(None, ge=1, validate_default=True)
    """The constant seq_mean_token_sum_norm divides each sequence's token sum by, and required
    by it: the longest response, e.g. ${inference.max_generated_tokens}. Unused by the other
    aggregations."""
    correction: Correction = "none"
    """Correction of the vLLM/trainer logprob mismatch, from r = exp(pi_old - behaviour): tis
    weights each token's policy term by min(r, correction_cap) (truncated importance sampling);
    mis by r, and by 0 (masked) where r is outside [correction_low, correction_cap] (masked
    importance sampling); icepop is mis per token with IcePop's band [0.5, 5]. With any of them
    the clipped ratio is taken against pi_old, and with ppo_epochs 1 it is always 1 (grpo
    validate refuses epsilon_low, epsilon_high or ratio_level: sequence beside it). none: the
    ratio against behaviour, no weight (docs/training.md)."""
    correction_level: Level = "token"
    """r per token, or per sequence: the product of its tokens' ratios, one weight (or mask)
    for all of them. icepop is token-level only."""
    correction_cap: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Upper bound C of r: tis truncates r at it, mis and icepop mask above it (for them at
    least 1). null: the correction's default (tis 2, mis 2, icepop 5)."""
    correction_low: float | None = Field(None, ge=0, validate_default=True)
    """Lower bound of r, at most 1 and below correction_cap: tis raises r to it, mis and icepop
    mask below it. null: the correction's default (none for tis and mis, 0.5 for icepop)."""
    tis_cap: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Older spelling of correction: tis with this correction_cap (tis_level then its
    correction_level); refused beside correction. null: off."""
    tis_level: Level = "token"
    """Older spelling of correction_level, read with tis_cap only."""
    ratio_level: Level = "token"
    """token (PPO/GRPO) or sequence (GSPO: length-normalised sequence ratio, clipped per
    sequence; use tiny epsilons such as 3e-4 / 4e-4)."""

    @field_validator("kl_estimator")
    @classmethod
    def _estimator_with_a_gradient(cls, value: str, info: ValidationInfo) -> str:
        kl_coeff = info.data.get("kl_coeff")
        if value == "k1" and isinstance(kl_coeff, (int, float)) and kl_coeff > 0:
            raise ValueError(
                f"k1 beside kl_coeff {kl_coeff} is refused: as a loss term k1 = log pi - log "
                "ref has zero expected gradient (E_pi[grad log pi] = 0), so it regularises "
                "nothing; use k3 (the gradient of KL(ref, pi): DeepSeekMath GRPO, verl's "
                "low_var_kl) or k2 (the gradient of KL(pi, ref))"
            )
        return value

    @field_validator("correction_level")
    @classmethod
    def _level_of_a_correction(cls, value: str, info: ValidationInfo) -> str:
        correction = info.data.get("correction")
        if value == "sequence" and correction == "icepop":
            raise ValueError(
                "icepop masks single tokens (IcePop's M(r) is per token, Ring-1T, "
                "arXiv:2510.18855); to mask whole sequences set correction: mis"
            )
        if value == "sequence" and correction == "none":
            raise ValueError("sequence corrects nothing with correction none; set correction")
        return value

    @field_validator("correction_cap")
    @classmethod
    def _cap_of_a_correction(cls, value: float | None, info: ValidationInfo) -> float | None:
        correction = info.data.get("correction")
        if value is not None and correction == "none":
            raise ValueError(f"{value} bounds nothing with correction none; set correction")
        if value is not None and correction in ("mis", "icepop") and value < 1:
            raise ValueError(
                f"{value} is below 1: {correction} would mask the tokens on which vLLM and the "
                "trainer agree (r = 1); use a bound >= 1, e.g. 2"
            )
        return value

    @field_validator("correction_low")
    @classmethod
    def _low_of_a_correction(cls, value: float | None, info: ValidationInfo) -> float | None:
        correction = info.data.get("correction")
        if value is not None and correction == "none":
            raise ValueError(f"{value} bounds nothing with correction none; set correction")
        if value is not None and value > 1:
            raise ValueError(
                f"{value} is above 1: it would mask (mis, icepop) or raise (tis) the weight of "
                "the tokens on which vLLM and the trainer agree (r = 1); use a bound <= 1, "
                "e.g. 0.5"
            )
        if correction is None or "correction_cap" not in info.data:
            return value  # refused already
        low, cap = correction_bounds(correction, value, info.data["correction_cap"])
        if low is not None and cap is not None and low >= cap:
            given = f"{low}" if value is not None else f"{low} ({correction}'s default)"
            raise ValueError(
                f"{given} is not below correction_cap {cap}: no ratio would keep its own "
                "weight; lower correction_low or raise correction_cap"
            )
        return value

    @field_validator("tis_cap")
    @classmethod
    def _old_cap_alone(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and info.data.get("correction", "none") != "none":
            raise ValueError(
                "is the older spelling of correction: tis with correction_cap; remove it "
                "beside correction"
            )
        return value

    @field_validator("tis_level")
    @classmethod
    def _old_level_alone(cls, value: str, info: ValidationInfo) -> str:
        if value == "sequence" and info.data.get("correction", "none") != "none":
            raise ValueError(
                "is the older spelling of correction_level; remove it beside correction"
            )
        return value

    @field_validator("max_response_len", mode="after")
    @classmethod
    def _dr_grpo_constant(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None and info.data.get("aggregation") == "seq_mean_token_sum_norm":
            raise ValueError(
                "required by aggregation seq_mean_token_sum_norm (each sequence's token sum "
                "is divided by this constant): set it to the longest response, e.g. "
                "${inference.max_generated_tokens}"
            )
        return value


def lora_served_merged(serve: str, on_cpu: bool) -> bool:
    """Whether collectors serve ``training.lora`` merged into the base weights, for its
    ``serve`` mode: ``auto`` is merged when their engine runs on CPU, the adapter on GPU
    (`LoRAConfig.serve` says why)."""
    return on_cpu if serve == "auto" else serve == "merged"


class LoRAConfig(Section):
    """Low-rank adapters (``training.lora``): only they are trained, synced and checkpointed."""

    rank: int = Field(ge=1)
    """Rank r of each adapter (vLLM serves ranks up to 512: 1, 8, 16, 32, 64, 128, 256, 320,
    512)."""
    alpha: float = Field(16.0, gt=0)
    """Scale: the adapter adds (alpha / rank) * B @ A to each wrapped weight."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input; only 0 trains (grpo validate refuses more): the
    collectors sample without dropout, so every logprob the loss and the weight sync compare
    must be computed without it too (docs/training.md)."""
    target_modules: list[LoRATarget] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1
    )
    """Linear layers to adapt, by Hugging Face name: q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj."""
    serve: Literal["auto", "adapter", "merged"] = "auto"
    """How the collectors' vLLM engines serve each synced adapter. adapter: as a vLLM LoRA
    adapter (LoRA kernels at every step). merged: each collector folds it into its copy of the
    base weights (W + (alpha / rank) * B @ A) and loads them in place; vLLM runs without LoRA
    and the update is verified like a full one. The trainer sends the adapter either way, and
    checkpoints hold only the adapter. auto: merged when the engine runs on CPU (no CUDA
    device), adapter on GPU. On CPU vLLM's LoRA layers copy each scheduled token's adapter
    matrices at every engine step (half the demo engine's time, profiled), while merging costs
    one merge and one in-place load per update (docs/training.md#lora)."""

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, value: float) -> float:
        if value > 0:
            raise ValueError(
                f"{value!r} is refused, only 0 trains: the collectors sample without dropout, "
                "and dropout makes the trainer's logprobs random: the weight probe would never "
                "match (every update fails verification) and the importance ratio pi / "
                "behaviour would compare a random sub-network with the policy that sampled; "
                "set 0"
            )
        return value


class TrainingConfig(Section):
    """Policy optimisation."""

    batch_size: int = Field(64, ge=1)
    """Trajectories per optimizer step, split evenly over the training workers."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each sampled batch."""
    optimizer: Component(OptimizerArgs) = Field(
        default_factory=lambda: {"_component_": "torch.optim.AdamW", "lr": 1e-6}
    )
    """Optimizer; the trainer passes the parameters positionally."""
    lr_scheduler: Component(LRSchedulerArgs) | None = None
    """Learning-rate schedule; the trainer passes the optimizer and num_training_steps
    (num_steps x ppo_epochs). null: constant."""
    loss: Component(LossArgs) = Field(default_factory=lambda: {"_component_": DEFAULT_LOSS})
    """GRPO loss on packed batches."""
    clip_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the gradient norm to this; null: no clipping."""
    dtype: DType = "fp32"
    """Parameter dtype."""
    mask_kind: MaskKind = "auto"
    """Attention of packed micro-batches: auto (flex on CUDA, varlen elsewhere), dense (an
    [L, L] bool mask), varlen (each sequence attends alone, similar lengths batched; fastest
    on CPU) or flex (FlexAttention BlockMask, O(L) memory; CUDA only for training)."""
    compile: bool = False
    """torch.compile each decoder layer (inductor); the first step pays the compile time.
    Varlen and flex attention run outside the compiled graphs."""
    lora: LoRAConfig | None = None
    """Train low-rank adapters on the frozen base model instead of every weight; null: full
    fine-tuning. Keys: rank, alpha, dropout, target_modules, serve. Only the adapters go to the
    collectors, which serve them as a vLLM LoRA adapter or merged into the base weights (serve:
    auto, adapter or merged; auto is merged on CPU, adapter on GPU), and the reference logprobs
    come from the base model with the adapter off (no reference model is loaded)."""
    num_gpus: float = Field(0, ge=0)
    """GPUs per training actor."""
    num_cpus: float = Field(1, ge=0)
    """CPUs per training actor."""
    resources: ActorResources = Field(default_factory=dict)
    """Ray custom resources per training actor, e.g. {trainer_node: 1}: they start only on
    nodes that have them (``ray start --resources='{"trainer_node": 4}'``), which places the
    role on chosen nodes of a cluster. A resource no node has is refused at start."""


# --------------------------------------------------------------------------------------------
# weight_sync: (trainer -> collectors)
# --------------------------------------------------------------------------------------------


class WeightSyncConfig(Section):
    """Weight sync (trainer to collectors)."""

    every_n_steps: int = Field(1, ge=1)
    """Optimizer steps between pushes of new weights to the collectors."""
    transport: WeightTransportKind = "collective"
    """collective: trainer rank 0 broadcasts the weights to each collector over its own
    two-rank process group (gloo on CPU, NCCL on GPU); object_store: through Ray's object
    store."""
    # 32 MiB on purpose: on CPU, glibc reuses freed blocks up to its 32 MiB mmap threshold,
    # while each bigger bucket is a fresh mapping paid in page faults on both ends
    # (scripts/bench_weight_sync.py). A tensor bigger than a bucket is sent alone.
    bucket_mb: float = Field(32.0, gt=0)
    """collective: tensors are sent in flat buckets of about this many MiB (a bigger tensor
    alone)."""
    timeout_s: float = Field(120.0, gt=0)
    """collective: limit in seconds of a channel's rendezvous and of each bucket's broadcast; a
    collector that does not keep up is treated as failed."""

    @property
    def bucket_bytes(self) -> int:
        """``bucket_mb`` in bytes."""
        return max(1, int(self.bucket_mb * 2**20))


# --------------------------------------------------------------------------------------------
# metric_logger: (a component; its documented keywords)
# --------------------------------------------------------------------------------------------


class MetricLoggerArgs(ComponentArgs):
    """Documented keywords of ``metric_logger``."""

    mode: WandbMode = COMPONENT_DEFAULT  # type: ignore[assignment]
    """W&B mode: online, offline or disabled."""
    project: str = COMPONENT_DEFAULT  # type: ignore[assignment]
    """W&B project."""
    log_dir: str = COMPONENT_DEFAULT  # type: ignore[assignment]
    """Folder for local logs."""
    stdout_every_n: StdoutEveryN = COMPONENT_DEFAULT  # type: ignore[assignment]
    """Print every n-th step of each actor to stdout; 0 prints nothing."""
