"""The run config: top-level options, one section per component, and checks across them.

The checks that involve more than one section read the plain values, so they run (and report)
beside the per-option checks even when some option is invalid. `ROLES` is the one table of
placed roles, which `grpo.preflight` reads.
"""

import inspect
from typing import Any, NamedTuple

from pydantic import Field

from grpo.choices import LogLevel
from grpo.config.instantiate import locate
from grpo.config.schema import Component, ComponentList, Section
from grpo.config.sections import (
    DEFAULT_LOSS,
    REWARD_TIMEOUT_S,
    CheckpointConfig,
    InferenceConfig,
    LossArgs,
    MetricLoggerArgs,
    OrchestrationConfig,
    RayConfig,
    RefConfig,
    RewardTimeout,
    TrainingConfig,
    WeightSyncConfig,
)
from grpo.config.signatures import static_overrides, static_reward_name

# Marks a value whose interpolation failed; the failure is already reported.
UNRESOLVED = object()
NUMBER = (int, float)


class Role(NamedTuple):
    """A kind of actor the config places: its name, which is also the section that holds its
    ``num_cpus``, ``num_gpus`` and ``resources`` (and the name of its actors, ``ref[0]``),
    and the ``orchestration`` key of its count."""

    name: str
    count_key: str


# Every placed role, in start order (`grpo.orchestrator.supervisor.ActorSupervisor
# .start_pipeline`): what the resource checks of `grpo.preflight`, the memory plan and the
# supervisor's placement check add up.
ROLES = (
    Role("ref", "num_ref_workers"),
    Role("inference", "num_inference_workers"),
    Role("training", "num_training_workers"),
)


class RunConfig(Section):
    """Top level.

    The whole run config as one typed object: top-level options, one section per component,
    and the component nodes (dataset, rewards, metric logger). `grpo.config.load_config`
    returns one.
    """

    base_model_path: str
    """Hugging Face model folder (config.json, *.safetensors, tokenizer.json). Relative:
    current directory first, then the repo root."""
    output_dir: str
    """Checkpoints, metrics and logs are written here."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    target_tokens_per_batch: int = Field(4096, ge=1)
    """Token budget of one packed micro-batch (prompt + response tokens). The longest possible
    sequence must fit."""
    share_prompts: bool = True
    """Pack the responses of a group after one copy of their shared prompt ([P R1 ... RG]) in
    the reference and training forward passes; logprobs and gradients are the same as with
    the prompt repeated, with fewer tokens to compute. false: one [P R] block per sequence."""
    resume_from_checkpoint: bool | str = False
    """false: start fresh; true: resume from the latest checkpoint in output_dir; a path:
    resume from that checkpoint."""
    overwrite_output_dir: bool = False
    """A fresh run (resume_from_checkpoint false) into an output_dir that holds a run is
    refused, so that two runs never share one metrics file, ledger or W&B history. true: move
    that run aside to <output_dir>.old-<time> (nothing is deleted) and start there."""
    debug_logging_enabled: bool = False
    """Log decoded sample prompts/responses every step."""
    debug_num_samples_per_step: int = Field(1, ge=0)
    """How many samples the debug log shows per step."""
    eval_every_n_steps: int | None = Field(None, ge=1)
    """Evaluate on eval_dataset every N training steps; null: never."""
    eval_num_examples: int | None = Field(None, ge=1)
    """Held-out examples per evaluation; null: all of eval_dataset."""
    eval_samples_per_example: int = Field(1, ge=1)
    """Episodes per held-out example: the k of eval/avg@k and eval/pass@k (docs/evaluation.md);
    above 1 needs eval_temperature above 0."""
    eval_temperature: float = Field(0.0, ge=0)
    """Sampling temperature of held-out evaluation; 0: greedy."""
    log_level: LogLevel = "info"
    """info: the terminal shows a progress bar and the results; each process's own output
    (vLLM, Ray, W&B) goes to output_dir/logs/. debug (grpo run --verbose): all of it on the
    terminal, with the grpo logger's debug messages."""
    reward_timeout_s: RewardTimeout = REWARD_TIMEOUT_S
    """Seconds one reward call may take before it scores 0 (math parsers can hang); for
    training and held-out evaluation."""
    ray: RayConfig = Field(default_factory=RayConfig)
    orchestration: OrchestrationConfig
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    ref: RefConfig = Field(default_factory=RefConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    reward_functions: ComponentList
    """Reward functions; each scores every response, the rewards are summed. Empty ([]) only
    with grpo.envs.AgentEnv, whose agent returns each episode's reward."""
    dataset: Component() | None = None
    """Training prompts and answers; null with an environment that brings its own tasks
    (grpo.envs.verifiers_env: the taskset's rows are the data), and only then."""
    eval_dataset: Component() | None = None
    """Evaluation prompts; null: no evaluation, or the held-out rows of an environment that
    generates its own tasks (grpo.envs.ReasoningGymEnv's eval_size)."""
    environment: Component() | None = None
    """Multi-turn environment that answers the policy's turns (tool results, user replies) and
    scores each episode with reward_functions, e.g. {_component_: grpo.envs.ToolEnv, tools:
    [grpo.envs.calculator], max_turns: 3}, or a verifiers environment ({_component_:
    grpo.envs.verifiers_env, taskset: MODULE}); null: single-turn (one response per prompt)."""
    metric_logger: Component(MetricLoggerArgs)
    """Metric logger, run as a Ray actor: grpo.observability.metric_logger.MetricLogger (JSONL, W&B,
    stdout) or your own class with its methods. log_dir and config default to the run folder
    and the resolved config."""

    def uses_reference_model(self) -> bool:
        """Whether the loss has a KL term to the reference model (``kl_coeff`` above 0).

        Without one the reference actor loads no model and computes no reference logprobs.
        An unset ``kl_coeff`` is the loss's default (`loss_defaults`); a loss class of your own
        with no ``kl_coeff`` keyword is taken to use the model.
        """
        node = dict(self.training.loss)
        defaults = loss_defaults(node["_component_"])
        kl_coeff = node.get("kl_coeff", defaults.get("kl_coeff"))
        return kl_coeff is None or float(kl_coeff) > 0.0

    @staticmethod
    def relation_problems(values: dict) -> list[str]:
        """Problems that involve more than one key.

        Each check skips when a key it needs is itself invalid (that key is reported on its
        own).

        Returns:
            list[str]: Each problem as ``key: what is wrong``.
        """
        problems: list[str] = []
        _check_relations(values, problems)
        return problems


def type_ok(value: Any, types: tuple[type, ...]) -> bool:
    """Whether `value` is one of `types` (ints count as floats; bools never as numbers)."""
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def value_at(values: dict, path: str, types: tuple[type, ...] = NUMBER) -> Any:
    """Value at a dotted path if present, resolved and of `types` (bool never a number)."""
    node: Any = values
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if node is UNRESOLVED or node is None or not type_ok(node, types):
        return None
    return node


def longest_sequence(values: dict, max_positions: int | None = None) -> tuple[int, str] | None:
    """Longest prompt + response a run can produce, and why; None if nothing bounds it here.

    As the collectors decide it. Single-turn: ``inference.max_prompt_tokens +
    inference.max_generated_tokens`` when the prompt bound is set; otherwise vLLM's
    ``max_model_len`` (the collectors then skip prompts longer than ``max_model_len -
    max_generated_tokens``), which defaults to the model's ``max_position_embeddings``. With an
    environment an episode grows turn by turn until the engine's context or
    ``environment.max_episode_tokens`` stops it (`grpo.envs.rollout`), whichever comes first
    (`_environment_sequence`).

    Args:
        max_positions (int | None): The model's ``max_position_embeddings``, if read.

    Returns:
        tuple[int, str] | None: The length and a description naming the keys it comes from.
    """
    if isinstance(values.get("environment"), dict):
        return _environment_sequence(values, max_positions)
    max_prompt = value_at(values, "inference.max_prompt_tokens", (int,))
    max_generated = value_at(values, "inference.max_generated_tokens", (int,))
    if max_prompt is not None:
        if max_generated is None:
            return None
        longest = max_prompt + max_generated
        return longest, (
            f"inference.max_prompt_tokens ({max_prompt}) + inference.max_generated_tokens "
            f"({max_generated}) = {longest}"
        )
    max_model_len = value_at(values, "inference.engine_args.max_model_len", (int,))
    if max_model_len is not None:
        return max_model_len, (
            f"inference.engine_args.max_model_len ({max_model_len}), the longest sequence "
            "while inference.max_prompt_tokens is null"
        )
    if max_positions is not None:
        return max_positions, (
            f"the model's max_position_embeddings ({max_positions}), the longest sequence "
            "while inference.max_prompt_tokens and inference.engine_args.max_model_len are null"
        )
    return None


def environment_context(values: dict) -> tuple[int, str, str] | None:
    """The engine's context of a run with an environment, as far as the config sets it.

    ``inference.engine_args.max_model_len``, or when that is null what the collector sets
    (`grpo.envs.Environment.response_budget`): ``max_prompt_tokens +
    max(max_generated_tokens, environment.max_episode_tokens)``. None when the config sets
    neither (the engine's context is then the model's ``max_position_embeddings``).

    Returns:
        tuple[int, str, str] | None: The length, a description, and the key to change.
    """
    context = value_at(values, "inference.engine_args.max_model_len", (int,))
    if context is not None:
        key = "inference.engine_args.max_model_len"
        return context, f"{key} ({context})", key
    max_prompt = value_at(values, "inference.max_prompt_tokens", (int,))
    max_generated = value_at(values, "inference.max_generated_tokens", (int,))
    episode = value_at(values, "environment.max_episode_tokens", (int,))
    if max_prompt is None or max_generated is None or episode is None:
        return None
    context = max_prompt + max(max_generated, episode)
    about = (
        f"inference.max_prompt_tokens ({max_prompt}) + max(inference.max_generated_tokens "
        f"({max_generated}), environment.max_episode_tokens ({episode})) = {context}, the "
        "engine's context while inference.engine_args.max_model_len is null"
    )
    if episode >= max_generated:
        return context, about, "environment.max_episode_tokens"
    return context, about, "inference.max_generated_tokens"


def _environment_sequence(values: dict, max_positions: int | None) -> tuple[int, str] | None:
    """`longest_sequence` of a run with an environment: its longest episode.

    An episode of a prompt of at most ``max_prompt_tokens`` ends at ``max_prompt_tokens +
    environment.max_episode_tokens`` or at the engine's context (`environment_context`; the
    model's ``max_position_embeddings`` when the config sets none), whichever comes first.
    """
    max_prompt = value_at(values, "inference.max_prompt_tokens", (int,))
    episode = value_at(values, "environment.max_episode_tokens", (int,))
    context = environment_context(values)
    if context is not None:
        length, about = context[0], context[1]
    elif max_positions is not None:
        length = max_positions
        about = (
            f"the model's max_position_embeddings ({max_positions}), the engine's context "
            "while inference.engine_args.max_model_len is null"
        )
    else:
        return None
    if episode is not None and max_prompt is not None and max_prompt + episode <= length:
        longest = max_prompt + episode
        return longest, (
            f"the longest episode, inference.max_prompt_tokens ({max_prompt}) + "
            f"environment.max_episode_tokens ({episode}) = {longest}"
        )
    unbounded = " (environment.max_episode_tokens is null)" if episode is None else ""
    return length, f"the longest episode, which fills {about}{unbounded}"


def _check_relations(values: dict, problems: list[str]) -> None:
    """Checks that involve more than one key; each skips when a key it needs is invalid."""
    longest = longest_sequence(values)
    budget = value_at(values, "target_tokens_per_batch", (int,))
    if longest is not None and budget is not None and budget < longest[0]:
        problems.append(
            f"target_tokens_per_batch: {budget} cannot hold the longest sequence, {longest[1]}"
        )
    max_model_len = value_at(values, "inference.engine_args.max_model_len", (int,))
    max_prompt = value_at(values, "inference.max_prompt_tokens", (int,))
    max_generated = value_at(values, "inference.max_generated_tokens", (int,))
    _check_episode_room(values, problems)
    if max_model_len is not None and max_generated is not None:
        if max_prompt is not None and max_model_len < max_prompt + max_generated:
            problems.append(
                f"inference.engine_args.max_model_len: {max_model_len} is shorter than "
                f"inference.max_prompt_tokens ({max_prompt}) + inference.max_generated_tokens "
                f"({max_generated}) = {max_prompt + max_generated}"
            )
        elif max_prompt is None and max_model_len <= max_generated:
            problems.append(
                f"inference.engine_args.max_model_len: {max_model_len} leaves no room for a "
                f"prompt before inference.max_generated_tokens ({max_generated}) while "
                "inference.max_prompt_tokens is null"
            )

    train_batch = value_at(values, "training.batch_size", (int,))
    num_trainers = value_at(values, "orchestration.num_training_workers", (int,))
    if train_batch is not None and num_trainers and train_batch % num_trainers:
        problems.append(
            f"training.batch_size: {train_batch} is not divisible by "
            f"orchestration.num_training_workers ({num_trainers}); each worker trains on an "
            "equal share"
        )
    # training.batch_size need not be a multiple of inference.group_size: advantages are
    # computed per whole group before trajectories enter the buffer, so a step may mix groups.
    buffer_size = value_at(values, "orchestration.replay_buffer_size", (int,))
    if buffer_size is not None and train_batch is not None and buffer_size < train_batch:
        problems.append(
            f"orchestration.replay_buffer_size: {buffer_size} is smaller than "
            f"training.batch_size ({train_batch}); a batch could never be sampled"
        )

    # With an environment, what it brings decides what the run must give (a dataset, held-out
    # rows, reward functions): its class says so, checked beside it (`grpo.preflight`).
    if not isinstance(values.get("environment"), dict):
        if (
            value_at(values, "eval_every_n_steps", (int,)) is not None
            and values.get("eval_dataset") is None
        ):
            problems.append("eval_every_n_steps: set, but eval_dataset is null")
        if values.get("reward_functions") == []:
            problems.append(
                "reward_functions: empty, but nothing else scores the episodes; give at least "
                "one (only an environment that scores its own episodes, such as "
                "grpo.envs.AgentEnv, runs without)"
            )
        if values.get("dataset") is None:
            problems.append(
                "dataset: required key is missing (only an environment with its own tasks, "
                "such as grpo.envs.verifiers_env, grpo.envs.ReasoningGymEnv or "
                "grpo.envs.TextArenaEnv, runs without one)"
            )
    samples = value_at(values, "eval_samples_per_example", (int,))
    temperature = value_at({"eval_temperature": 0.0, **values}, "eval_temperature")
    if samples is not None and samples > 1 and temperature == 0:
        problems.append(
            f"eval_samples_per_example: {samples} samples at eval_temperature 0 are identical "
            "greedy samples (pass@k would equal avg@k); set eval_temperature above 0 (e.g. "
            "1.0) or eval_samples_per_example: 1"
        )

    weights = value_at(values, "ref.reward_weights", (dict,))
    names = reward_names(values)
    if weights and names is not None and (problem := reward_weights_problem(weights, names)):
        problems.append(problem)

    engine_args = value_at(values, "inference.engine_args", (dict,))
    if engine_args and "model" in engine_args:
        problems.append("inference.engine_args.model: the model comes from base_model_path")
    _check_sampled_distribution(values, problems)
    _check_policy_lag(values, problems)
    _check_idle_clip(values, problems)
    _check_time_sharing(values, problems)
    _check_synchronous_queue(values, problems)
    _check_shared_gpu_transport(values, problems)


def _check_episode_room(values: dict, problems: list[str]) -> None:
    """An episode of the longest prompt must reach ``max_episode_tokens`` within the engine's
    context, or its bound is the context, silently."""
    episode = value_at(values, "environment.max_episode_tokens", (int,))
    context = value_at(values, "inference.engine_args.max_model_len", (int,))
    if episode is None or context is None or not isinstance(values.get("environment"), dict):
        return
    max_prompt = value_at(values, "inference.max_prompt_tokens", (int,))
    if max_prompt is not None and max_prompt + episode > context:
        problems.append(
            f"environment.max_episode_tokens: inference.max_prompt_tokens ({max_prompt}) + "
            f"{episode} exceeds inference.engine_args.max_model_len ({context}): episodes would "
            "end at the engine's context first; raise max_model_len or lower one of them"
        )
    elif max_prompt is None and episode >= context:
        problems.append(
            f"environment.max_episode_tokens: {episode} leaves no room for a prompt in "
            f"inference.engine_args.max_model_len ({context})"
        )


def _check_sampled_distribution(values: dict, problems: list[str]) -> None:
    """The loss compares the trainer's logprobs with the engine's of the tokens it sampled:
    both must be those of the distribution that sampled them."""
    top_p = value_at(values, "inference.top_p")
    if top_p is not None and 0 < top_p < 1:
        problems.append(
            f"inference.top_p: {top_p} is refused, only 1.0 trains: the trainer's logprobs are "
            "those of the whole tempered distribution, not of the nucleus the engine samples "
            "from, so the importance ratio would compare against a distribution that did not "
            "sample the tokens; lower inference.temperature to sample more sharply"
        )
    mode = value_at(values, "inference.engine_args.logprobs_mode", (str,))
    if mode is not None and mode != "processed_logprobs":
        problems.append(
            f"inference.engine_args.logprobs_mode: {mode!r} is refused; the behaviour logprobs "
            "must be processed_logprobs (the default), those of the tempered distribution that "
            "sampled the tokens, which the trainer's are compared with"
        )


def _check_policy_lag(values: dict, problems: list[str]) -> None:
    """The lag counts training steps, and the collectors' newest weights trail the trainer's
    by up to ``every_n_steps - 1`` of them: a smaller bound leaves steps with no batch."""
    lag = value_at(values, "orchestration.max_policy_lag", (int,))
    every = value_at(values, "weight_sync.every_n_steps", (int,))
    # An out-of-range value is reported by its own check.
    if lag is not None and every is not None and 0 <= lag < every - 1:
        problems.append(
            f"orchestration.max_policy_lag: {lag} is less than weight_sync.every_n_steps - 1 "
            f"({every - 1}): the lag counts training steps, and before each sync the "
            f"collectors' newest weights are up to {every - 1} step{'s' if every > 2 else ''} "
            "older than the trainer's, "
            "so those steps could never get a batch; raise max_policy_lag to "
            f"{every - 1} or set weight_sync.every_n_steps to {lag + 1}"
        )


def _check_time_sharing(values: dict, problems: list[str]) -> None:
    """vLLM sleeps while the trainer steps: only a synchronous run generates nothing then."""
    sleeps = value_at(values, "inference.sleep_while_training", (bool,))
    # Unset is the default, asynchronous.
    if sleeps and value_at(values, "orchestration.synchronous", (bool,)) is not True:
        problems.append(
            "inference.sleep_while_training: needs orchestration.synchronous: true (vLLM "
            "sleeps while the trainer steps, so nothing may generate meanwhile)"
        )


def _check_synchronous_queue(values: dict, problems: list[str]) -> None:
    """A synchronous round scores only once every collector finished its batch, so the rollout
    queue must hold all their groups at once: a collector blocked on a full queue waits
    forever."""
    if value_at(values, "orchestration.synchronous", (bool,)) is not True:
        return
    inference, orchestration = InferenceConfig.model_fields, OrchestrationConfig.model_fields
    batch = value_at(values, "inference.batch_size", (int,)) or inference["batch_size"].default
    workers = (
        value_at(values, "orchestration.num_inference_workers", (int,))
        or orchestration["num_inference_workers"].default
    )
    room = value_at(values, "inference.queue_maxsize", (int,)) or inference["queue_maxsize"].default
    if batch * workers > room:
        problems.append(
            f"inference.queue_maxsize: {room} groups is less than a synchronous round puts on "
            f"the queue before any is scored (inference.batch_size {batch} x "
            f"orchestration.num_inference_workers {workers} = {batch * workers}); raise "
            "queue_maxsize or lower batch_size"
        )


def _check_shared_gpu_transport(values: dict, problems: list[str]) -> None:
    """NCCL refuses two ranks on one device ("Duplicate GPU detected"): a trainer and a
    collector that may share a GPU (fractions of one each) cannot open a collective channel."""
    transport = value_at(values, "weight_sync.transport", (str,)) or "collective"
    inference = value_at(values, "inference.num_gpus", (int, float)) or 0
    training = value_at(values, "training.num_gpus", (int, float)) or 0
    if transport == "collective" and 0 < inference < 1 and 0 < training < 1:
        problems.append(
            f"weight_sync.transport: collective broadcasts over NCCL, which refuses a trainer "
            f"and a collector on the same GPU, and fractions of a GPU (inference.num_gpus "
            f"{inference}, training.num_gpus {training}) put them on one; set "
            "weight_sync.transport: object_store"
        )


def _check_idle_clip(values: dict, problems: list[str]) -> None:
    """With a mismatch correction and one epoch the clip has nothing to clip: say which keys
    do nothing."""
    loss = value_at(values, "training.loss", (dict,))
    if not loss:
        return
    # The key that turned the correction on, and what turns it off.
    if loss.get("tis_cap") not in (None, UNRESOLVED):
        key, off = "tis_cap", "null"
    elif loss.get("correction") not in (None, "none", UNRESOLVED):
        key, off = "correction", "none"
    else:
        return
    if (value_at(values, "training.ppo_epochs", (int,)) or 1) != 1:  # unset: the default, 1
        return
    # A clip range left at the loss's own default is no choice of the user's (the shipped
    # configs list theirs): only one set to something else is said to do nothing.
    defaults = loss_defaults(loss.get("_component_"))
    idle = [
        name
        for name in ("epsilon_low", "epsilon_high")
        if name in loss and (name not in defaults or loss[name] != defaults[name])
    ]
    if loss.get("ratio_level") == "sequence":
        idle.append("ratio_level: sequence")
    if idle:
        problems.append(
            f"training.loss.{key}: with training.ppo_epochs 1 the clipped ratio is taken "
            f"against the current policy and is always 1, so {', '.join(idle)} "
            f"{'has' if len(idle) == 1 else 'have'} no effect (the loss is the weighted "
            f"policy gradient); remove them, set ppo_epochs >= 2 (decoupled PPO) or {key}: "
            f"{off} (the ratio to the behaviour policy is clipped)"
        )


def loss_defaults(component: Any) -> dict[str, Any]:
    """The keyword defaults of the ``training.loss`` component at a dotted path.

    For `DEFAULT_LOSS`, those the config declares (`LossArgs`), so that reading a config
    imports no loss; for a loss of your own, its signature's (imported as `instantiate` would
    import it).

    Returns:
        dict[str, Any]: Keyword name -> default; {} if the component does not import (the
        component check reports that).
    """
    if component == DEFAULT_LOSS:
        return {name: info.default for name, info in LossArgs.model_fields.items()}
    try:
        parameters = inspect.signature(locate(component)).parameters
    except Exception:  # a missing component is the component check's to report
        return {}
    return {
        name: parameter.default
        for name, parameter in parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }


def reward_names(values: dict) -> list[str] | None:
    """The names of the rewards a run's episodes are scored under, read from the config.

    Without an environment, or with one that scores with its reward functions (a
    `grpo.envs.MultiTurnEnv` subclass that keeps its ``score``), the reward functions' names:
    a node's ``name``, else the class's own ``name`` or a ``reward_function``'s, read from
    source. Other environments name their rewards as they score (a verifiers taskset's):
    their names are checked once the environment is built
    (`grpo.envs.MultiTurnEnv.reward_names`), or at the latest when it first scores.

    Returns:
        list[str] | None: The names; None when the config does not tell (checked at start).
    """
    functions = values.get("reward_functions")
    environment = values.get("environment")
    if isinstance(environment, dict):
        target = environment.get("_component_")
        # Only an environment that keeps MultiTurnEnv's `score` scores with reward functions.
        if (
            not isinstance(target, str)
            or static_overrides(target, "score", "MultiTurnEnv") is not False
        ):
            return None
        functions = environment.get("reward_functions", functions)
    if not isinstance(functions, list):
        return None
    names = []
    for node in functions:
        if not isinstance(node, dict):
            return None
        name = node.get("name")
        if name is None and isinstance(node.get("_component_"), str):
            name = static_reward_name(node["_component_"])
        if not isinstance(name, str):
            return None
        names.append(name)
    return names


def reward_weights_problem(weights: Any, names: list[str]) -> str | None:
    """Why ``ref.reward_weights`` does not fit rewards named ``names``, or None if it does.

    Returns:
        str | None: One line naming the unknown names and the known ones.
    """
    unknown = [name for name in weights if name not in names]
    if not unknown:
        return None
    return (
        f"ref.reward_weights: no reward named {', '.join(map(repr, unknown))}; the rewards are "
        f"{', '.join(names)}"
    )
