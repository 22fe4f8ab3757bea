"""The generation actor: a vLLM engine sampling GRPO groups from its own shard of the prompts.

Data flow::

    PromptStream(worker shard) -> model folder's tokenizer -> vLLM (n = group_size per prompt)
        -> one GroupedUnscoredTrajectories per prompt -> rollout queue (blocking, bounded)

Choices that other actors rely on:

* Prompt token ids come from the model folder's tokenizer (`grpo.models.load_tokenizer`, the
  same files and library vLLM loads), the one the reference and training actors use, and reach
  vLLM as ``TokensPrompt``; vLLM's own tokenizer only detokenizes for stop strings.
* A response holds the tokens vLLM sampled, unpadded, INCLUDING the token that ended it (the
  eos token, or the token that completed a stop string such as ``</answer>``): the policy is
  trained on stopping, and the ratio of that token is part of the loss. A response cut by
  ``max_generated_tokens`` simply ends there.
* Behaviour logprobs are vLLM's ``processed_logprobs``: log-softmax of the logits divided by
  the sampling temperature, the distribution that sampled the tokens. The trainer and the
  reference actor divide their logits by the same ``inference.temperature``
  (`grpo.packing.logprobs`); ``top_p`` stays 1 (`grpo validate` refuses less: the trainer cannot
  reproduce the nucleus).
* ``sequence_id`` is ``f"w{worker_id}-{n}"`` and ``group_id`` is
  ``worker_id + num_workers * k`` for the worker's k-th prompt, so both are unique across
  workers with no coordination. Every group's request seed is derived from ``seed`` and its
  ``group_id``: a resumed stream regenerates exactly the same samples from the same weights.
* New weights arrive through `receive_weights` at any time. With ``weight_updates:
  in_flight`` (the default) they are loaded between two steps of the engine's scheduler while
  a batch generates: vLLM preempts the running sequences and prefills each again (prompt and
  tokens so far) with the new weights, so every token after the switch is the new policy's,
  and the behaviour logprobs stay those of the weights that sampled each token. A trajectory
  carries the version of its oldest token (``policy_version``) and of its newest
  (``last_policy_version``). An update that fails verification is rolled back (the engine
  reloads the weights it had) and counted. With ``in_flight_keep_kv`` the running sequences
  keep the KV cache the old weights computed (no second prefill); with ``between_batches``
  updates wait for the next batch.
* With an ``environment`` (`grpo.envs`), an episode is a conversation: the collector samples
  the policy's turns on its engine run continuously (`TurnEngine`: a turn joins the running
  batch as soon as its episode is ready), the environment answers them and scores the
  finished episode, and each trajectory carries the environment's tokens with
  ``response_mask`` False and the environment's rewards. A verifiers environment plays its
  own episodes and asks the engine over HTTP (`grpo.envs.verifiers_env`).

The orchestrator makes it a threaded Ray actor (`SyncLLMCollector.as_remote`) and drives it
one batch at a time with `generate_batch_with_state`; `receive_weights` and `evaluate` reach it
while a batch waits on a full rollout queue.

The module is over 500 lines on purpose: it is one actor (and the ``inference:`` options it
declares), whose methods all share the engine, the prompt stream and the weight receiver.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from grpo.config.sections import InferenceConfig
from grpo.envs.dropped import BatchDrops, DroppedEpisodeLog
from grpo.seeds import group_seed
from grpo.types import GroupedUnscoredTrajectories, UnscoredTrajectory
from grpo.weights.base import COLLECTOR_CONCURRENCY_GROUPS
from grpo.weights.channel import TensorSpec
from grpo.weights.collective import ChannelReceiver
from grpo.weights.engine import (
    WORKER_EXTENSION_CLS,
    WeightReceiver,
    WeightSyncError,
    WeightUpdate,
)

log = logging.getLogger(__name__)

# vLLM settings that make a CPU engine start in seconds and fit beside other processes.
CPU_ENGINE_DEFAULTS: dict[str, Any] = {
    # No CUDA graphs or torch.compile on CPU: compilation takes minutes, eager is fast enough.
    "enforce_eager": True,
    # float32: the behaviour logprobs then match an fp32 trainer's forward to ~1e-6. bfloat16
    # is faster on CPUs with bf16 units; pass dtype in engine_args to choose it.
    "dtype": "float32",
    # An explicit KV cache size. The default sizes it as a fraction of the NUMA node's memory
    # minus this process's RSS, which fails as soon as other processes hold memory.
    "kv_cache_memory_bytes": 512 * 2**20,
}
ENGINE_DEFAULTS: dict[str, Any] = {
    "worker_extension_cls": WORKER_EXTENSION_CLS,
    # The logprobs of the distribution that sampled (after temperature), not of the raw
    # logits: the importance ratio and TIS weights compare the trainer's against them.
    "logprobs_mode": "processed_logprobs",
}


def engine_kwargs(
    engine_args: Mapping[str, Any] | None, seed: int, on_cpu: bool | None = None
) -> dict[str, Any]:
    """The keyword arguments for ``vllm.LLM``: defaults, then ``engine_args`` on top.

    Args:
        engine_args (Mapping[str, Any] | None): User settings; they win over every default.
        seed (int): Engine seed (per-request seeds make sampling reproducible anyway).
        on_cpu (bool | None): Apply `CPU_ENGINE_DEFAULTS`; default: when CUDA is unavailable.

    Returns:
        dict[str, Any]: Arguments for ``vllm.LLM(model=..., **kwargs)``.
    """
    if on_cpu is None:
        on_cpu = not torch.cuda.is_available()
    kwargs: dict[str, Any] = {"seed": seed, **ENGINE_DEFAULTS}
    if on_cpu:
        kwargs.update(CPU_ENGINE_DEFAULTS)
    kwargs.update(dict(engine_args or {}))
    return kwargs


def response_budget(max_generated_tokens: int, environment: Any = None) -> int | None:
    """The most response tokens of one trajectory, which the engine's context must hold.

    Single-turn: ``max_generated_tokens``. With an environment, its whole episode (every
    policy and environment turn): ``max(max_generated_tokens, max_episode_tokens)``; an
    environment without ``max_episode_tokens`` runs until the engine's context, so None. A
    collector sizes ``max_model_len`` by it when the config leaves it unset: sized by one
    turn, every episode would end where one turn's tokens do.

    Args:
        max_generated_tokens (int): ``inference.max_generated_tokens``.
        environment: The run's environment, or None.

    Returns:
        int | None: The budget; None when only the context bounds it.
    """
    if environment is None:
        return max_generated_tokens
    episode = getattr(environment, "max_episode_tokens", None)
    return None if episode is None else max(max_generated_tokens, int(episode))


def whole_prefills(kwargs: Mapping[str, Any], model_dir: str) -> dict[str, Any]:
    """Engine arguments that never split a prompt's prefill across steps (the CPU default).

    vLLM 0.32 rewinds the sampling generator of a seeded request whose prefill was split
    (chunked prefill), and the CPU generator has no offset to rewind: ``RuntimeError: CPU
    Generator does not use offset`` as soon as a batch's prompts exceed one step's token budget
    (64 samples of a 100-token prompt). Without chunked prefill a prompt that does not fit the
    step waits for the next one, whole; the budget must then hold the longest sequence.

    Returns:
        dict[str, Any]: ``enable_chunked_prefill`` False and ``max_num_batched_tokens`` at
        least ``max_model_len`` (the model's ``max_position_embeddings`` when not set).
    """
    from grpo.models.hf_folder import load_hf_config

    max_model_len = kwargs.get("max_model_len") or load_hf_config(model_dir).get(
        "max_position_embeddings", 0
    )
    budget = max(int(kwargs.get("max_num_batched_tokens") or 4096), int(max_model_len))
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": budget}


def check_in_flight_updates(llm_engine: Any) -> None:
    """Refuse an engine that cannot take weights while it generates.

    An in-flight update preempts the running requests so that they are prefilled again with
    the new weights (``reset_prefix_cache(reset_running_requests=True)``, vLLM >= 0.11).

    Raises:
        ValueError: Naming ``inference.weight_updates`` and the setting that works.
    """
    import inspect

    reset = getattr(llm_engine, "reset_prefix_cache", None)
    if reset is None or "reset_running_requests" not in inspect.signature(reset).parameters:
        import vllm

        raise ValueError(
            f"inference.weight_updates: in_flight needs a vLLM engine that can preempt its "
            f"running requests (LLMEngine.reset_prefix_cache(reset_running_requests=True)), "
            f"and vLLM {vllm.__version__} cannot; set inference.weight_updates=between_batches"
        )


# Consecutive rejected in-flight updates after which the collector stops: weights that never
# verify are a fault to report, not a reason to keep sampling with ever older ones.
MAX_REJECTED_UPDATES_IN_A_ROW = 3
# The label of tokens sampled with weights that then failed verification (the running samples
# go on while the probe runs). A sample holding any is sampled again from its start, never
# trained on.
UNVERIFIED_VERSION = -1

_TURN_IDS = itertools.count()  # request ids of policy turns, unique in the process
_REQUEST_IDS = itertools.count()  # request ids of groups and probes


class TurnEngine:
    """A collector's vLLM engine as a continuous `grpo.envs.rollout.TurnEngine`.

    Each turn is a request of its own in vLLM's engine, added when its episode is ready; each
    step runs the engine's scheduler once (a decode step of every running request, prefill of
    new ones), so a turn joins the running batch without waiting for the others to finish.
    The caller holds the collector's engine lock from the first submit to the last step: a
    ``generate`` call in between would run these requests to completion as its own.
    """

    def __init__(self, collector: SyncLLMCollector, greedy: bool = False) -> None:
        self.collector = collector
        self.greedy = greedy
        # vLLM request id -> (the key `submit` returned, the request): a turn sampled partly
        # with weights that failed verification is sampled again under a new id.
        self._running: dict[str, tuple[str, Any]] = {}

    def submit(self, request: Any, key: str | None = None) -> str:
        params = self.collector._sampling_params(
            request.seed, request.max_tokens, 1, request.stop, self.greedy
        )
        request_id = f"turn-{next(_TURN_IDS)}"
        self.collector._add_request(request_id, request.token_ids, params)
        self._running[request_id] = (key or request_id, request)
        return request_id

    def step(self) -> list[tuple[str, Any]]:
        from grpo.envs import Sample

        finished = []
        # Greedy turns are evaluation: the weights stay those it started with.
        for output, runs in self.collector._step(load_pending=not self.greedy):
            if output.request_id not in self._running:
                continue
            key, request = self._running.pop(output.request_id)
            if any(v == UNVERIFIED_VERSION for sample in runs for v, _ in sample):
                self.submit(request, key)
                continue
            [completion] = output.outputs
            sample = Sample(
                list(completion.token_ids),
                self.collector._sampled_logprobs(completion, "policy turn"),
                completion.finish_reason or "stop",
            )
            finished.append((key, sample))
        return finished


def _is_dead_actor(error: BaseException) -> bool:
    """``error`` says that the Ray actor called (the rollout queue) is dead."""
    from ray.exceptions import RayActorError

    return isinstance(error, RayActorError)


def _resolve_dataset(dataset: Any) -> Sequence[dict[str, Any]]:
    """A dataset object, or a ``_component_`` config node built with `grpo.config.instantiate`."""
    if isinstance(dataset, Mapping):
        from grpo.config import instantiate

        return instantiate(dataset, _key_="dataset")
    if dataset is None or not isinstance(dataset, Sequence):
        raise TypeError(
            "dataset must be a sequence of {'question', 'answer'} dicts (e.g. a PromptDataset) "
            f"or a mapping with a _component_ key, got {type(dataset).__name__}"
        )
    return dataset


def episode_metrics(
    episodes: Sequence[Any], dropped: int, dropped_total: float
) -> dict[str, float]:
    """``inference/episode_*`` and ``inference/tool_*`` metrics of one batch of multi-turn
    episodes (`grpo.envs.Episode`)."""
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
        "inference/episode_turns_mean": sum(e.num_turns for e in episodes) / count,
        "inference/episode_turns_max": float(max((e.num_turns for e in episodes), default=0)),
        "inference/episode_turn_length_mean": policy_tokens / max(len(turn_lengths), 1),
        "inference/episode_env_token_fraction": env_tokens / max(env_tokens + policy_tokens, 1),
        "inference/episode_truncated": float(sum(e.truncated for e in episodes)),
        "inference/episode_hit_max_turns": float(sum(e.hit_max_turns for e in episodes)),
        "inference/episodes_dropped": float(dropped),
        "inference/episodes_dropped_total": dropped_total,
        "inference/tool_calls_per_episode": sum(e.tool_calls for e in episodes) / count,
        "inference/tool_errors": float(sum(errors.values())),
        "inference/tool_timeouts": float(errors.get("timeout", 0)),
        # Time calls waited for a free tool worker (not part of their timeout): a pool too
        # small for the load (`ToolEnv(tool_workers=...)`) shows here.
        "inference/tool_queue_wait_mean (s)": sum(waits) / max(len(waits), 1),
        "inference/tool_queue_wait_max (s)": max(waits, default=0.0),
    }
    for kind, number in errors.items():
        metrics[f"inference/tool_errors_{kind}"] = float(number)
    # An environment's own metrics (a verifiers taskset's), each the mean over the episodes
    # that report it.
    env_metrics: dict[str, list[float]] = {}
    for episode in episodes:
        for name, value in episode.state.get("metrics", {}).items():
            env_metrics.setdefault(name, []).append(float(value))
    for name, values in env_metrics.items():
        metrics[f"inference/env_{name}"] = sum(values) / len(values)
    return metrics


def build_environment(
    environment: Any, reward_functions: Sequence[Any], reward_timeout_s: float
) -> Any:
    """An environment object, built from its ``_component_`` node if need be (or None).

    The node gets the run's ``reward_functions`` and ``reward_timeout_s`` unless it names its
    own. The driver builds it once before any actor starts (`recipes/async_grpo.py`), so a bad
    value is one line there, not an error in a collector.

    Raises:
        ConfigError: If the environment cannot be built, naming the key and the reason.
    """
    if environment is None or not isinstance(environment, Mapping):
        return environment
    from grpo.config import ConfigError, instantiate

    node = dict(environment)
    node.setdefault("reward_functions", list(reward_functions))
    node.setdefault("reward_timeout_s", reward_timeout_s)
    try:
        return instantiate(node, _key_="environment")
    except ConfigError:
        raise
    except Exception as error:  # the environment's own check of its arguments
        raise ConfigError(f"environment: {error}") from error


class SyncLLMCollector:
    """Generates GRPO groups with vLLM from one shard of a prompt dataset.

    Args:
        worker_id (int): Index of this collector, in ``[0, num_workers)``.
        num_workers (int): Number of collectors sharing the dataset.
        model_dir (str): Hugging Face model folder (weights, config, tokenizer files).
        dataset: A sequence of examples (``PromptDataset``) or a ``_component_`` config node.
        rollout_queue: Where groups go: anything with ``put(item, block=True, timeout=...)``
            raising ``queue.Full`` on timeout (``ray.util.queue.Queue``, ``queue.Queue``).
        config (InferenceConfig | None): The ``inference:`` options this actor uses
            (``group_size``, ``max_generated_tokens``, ``temperature``, ``top_p``,
            ``max_prompt_tokens``, ``queue_put_timeout_s``, ``weight_check_every_n_batches``,
            ``engine_args``); None: their defaults. ``engine_args`` are merged over
            `CPU_ENGINE_DEFAULTS` (on CPU) and `ENGINE_DEFAULTS`; without ``max_model_len``
            it is ``max_prompt_tokens`` + `response_budget` when both are set (the model's
            context otherwise), and a null ``max_prompt_tokens`` becomes ``max_model_len`` minus
            the budget (or ``max_generated_tokens``). A put that times out is counted as a wait
            and tried again:
            groups are never dropped. Prompts longer than ``max_prompt_tokens`` are skipped
            (counted in ``inference/skipped_long_prompts``).
        seed (int): Seeds the prompt order and every request's sampler.
        policy_version (int): The policy version of the weights in ``model_dir`` (0: the base
            model; a checkpoint's version when a run resumes or restarts from it). What the
            engine samples is labelled with it until new weights are applied.
        verify_weights (bool): Check the checksum of every received update.
        environment: A multi-turn environment (`grpo.envs.MultiTurnEnv`) or its
            ``_component_`` node; None: single-turn (one sampled response per episode, scored
            by the reference actor).
        reward_functions (Sequence): The run's reward functions (nodes or objects), given to
            an environment node that names none of its own.
        reward_timeout_s (float): Timeout of one reward call, likewise.

    Raises:
        ValueError: On inconsistent sizes (worker id out of range, a shard that is empty, no
            room for a prompt in ``max_model_len``).

    Example:
        >>> config = InferenceConfig(group_size=4, max_generated_tokens=16)
        >>> collector = SyncLLMCollector(0, 1, "tiny", dataset, q, config)
        >>> collector.generate_batch(8)["inference/num_groups"]
        8.0
    """

    def __init__(
        self,
        worker_id: int,
        num_workers: int,
        model_dir: str | os.PathLike,
        dataset: Any,
        rollout_queue: Any,
        config: InferenceConfig | None = None,
        *,
        seed: int = 0,
        policy_version: int = 0,
        verify_weights: bool = True,
        environment: Any = None,
        reward_functions: Sequence[Any] = (),
        reward_timeout_s: float = 10.0,
    ) -> None:
        config = config or InferenceConfig()
        max_generated_tokens = config.max_generated_tokens
        # The engine runs inside this process: start-up in seconds instead of a separate
        # engine-core process (~25 s on CPU), and weight updates pass tensors by reference.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        from grpo.data.stream import PromptStream
        from grpo.models import load_tokenizer

        self.worker_id = worker_id
        self.num_workers = num_workers
        self.model_dir = str(model_dir)
        self.group_size = config.group_size
        self.max_generated_tokens = max_generated_tokens
        self.temperature = float(config.temperature)
        self.top_p = float(config.top_p)
        self.rollout_queue = rollout_queue
        self.seed = seed
        self.queue_put_timeout_s = float(config.queue_put_timeout_s)
        self.verify_weights = verify_weights
        self.weight_check_every_n_batches = config.weight_check_every_n_batches

        # An environment that brings its own tasks (a verifiers taskset) is the dataset of a
        # run that names none.
        self.environment = build_environment(environment, reward_functions, reward_timeout_s)
        if dataset is None and getattr(self.environment, "supplies_tasks", False):
            dataset = self.environment.examples()
        self.dataset = _resolve_dataset(dataset)
        self.stream = PromptStream(self.dataset, worker_id, num_workers, seed=seed)
        self.tokenizer = load_tokenizer(self.model_dir)
        # Each example's "prompt" is rendered by the dataset's template, whose stop strings
        # end a response (the tokens that complete one are kept).
        prompt_template = getattr(self.dataset, "template", None)
        self.stop_strings = list(getattr(prompt_template, "stop", ()))
        # A chat template's text already holds the model's leading special tokens (Llama 3's
        # writes <|begin_of_text|>): adding a bos on top would start the prompt with two.
        self.add_bos = bool(getattr(prompt_template, "add_bos", True))

        kwargs = engine_kwargs(config.engine_args, seed)
        max_prompt_tokens = config.max_prompt_tokens
        # The longest response: one turn, or a whole episode with an environment.
        response_tokens = response_budget(max_generated_tokens, self.environment)
        if "max_model_len" not in kwargs and max_prompt_tokens is not None:
            if response_tokens is not None:  # else: the model's context
                kwargs["max_model_len"] = max_prompt_tokens + response_tokens
        user_args = config.engine_args or {}
        if not torch.cuda.is_available() and "enable_chunked_prefill" not in user_args:
            kwargs.update(whole_prefills(kwargs, self.model_dir))
        self.weight_updates = config.weight_updates
        self.llm = LLM(model=self.model_dir, **kwargs)
        if self._updates_in_flight:
            check_in_flight_updates(self.llm.llm_engine)
        # Prefix-cache blocks the old weights computed, still held by running sequences when
        # new weights came (in_flight_keep_kv): dropped as soon as the engine is idle.
        self._stale_prefix_cache = False
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        if max_prompt_tokens is None:
            max_prompt_tokens = self.max_model_len - (response_tokens or max_generated_tokens)
        if max_prompt_tokens < 1 or max_prompt_tokens + max_generated_tokens > self.max_model_len:
            raise ValueError(
                f"max_prompt_tokens={max_prompt_tokens} + max_generated_tokens="
                f"{max_generated_tokens} must fit in vLLM's max_model_len={self.max_model_len}"
            )
        self.max_prompt_tokens = max_prompt_tokens

        # Multi-turn episodes: the environment answers each policy turn and scores the episode
        # (with the run's reward functions unless its node names its own). A verifiers
        # environment renders its own turns.
        self.renderer = None
        if self.environment is not None and not self._plays_own_episodes:
            from grpo.envs import ChatTurnRenderer, PlainTurnRenderer

            # Environment turns are written like the prompt: as the chat template renders
            # them after a chat-template prompt, as plain text after a plain one.
            if getattr(prompt_template, "chat", False):
                self.renderer = ChatTurnRenderer(
                    self.tokenizer,
                    getattr(prompt_template, "chat_template_kwargs", None),
                    roles=self.environment.env_roles,
                )
            else:
                self.renderer = PlainTurnRenderer(self.tokenizer)

        self.weights = WeightReceiver()
        self._weights_error: str | None = None  # set while the engine holds unverified weights
        self.policy_version = int(policy_version)
        # In-flight updates: the version of the weights the engine samples with right now (the
        # new one while it is being verified), the weights to roll back to (None: the model
        # folder's, while `_can_roll_back`), and for each running sample the versions of its
        # tokens so far.
        self._sampling_version = self.policy_version
        self._loaded_weights: Mapping[str, torch.Tensor] | None = None
        self._can_roll_back = True
        self._token_versions: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self._held_outputs: list[tuple[Any, list[list[tuple[int, int]]]]] = []
        self._rejected_in_a_row = 0
        self._batch_switches = {"updates": 0.0, "pause_s": 0.0}
        self.sequence_counter = 0
        self.group_counter = 0
        self.batch_counter = 0
        # Cumulative counters, readable while a batch runs.
        self.totals: dict[str, float] = {
            "queue_put_waits": 0.0,
            "skipped_long_prompts": 0.0,
            "episodes_dropped": 0.0,
            "weight_updates_in_flight": 0.0,
            "weight_updates_rejected": 0.0,
        }
        # Episodes the environment failed: each reason logged once with a count, and the last
        # batch's counts, for the driver (`generate_batch_with_state`).
        self.dropped_episodes = DroppedEpisodeLog(f"collector {worker_id}")
        self._batch_drops: BatchDrops | None = None
        # The last batch's groups, for `generate_batch_with_state` to return.
        self._batch_groups: list[GroupedUnscoredTrajectories] = []
        # vLLM's engine is not thread-safe; a threaded actor serialises calls on it here.
        self._engine_lock = threading.RLock()
        # For `heartbeat`: when the engine step now running began (None: none is), how many
        # steps ran, and since when a batch waits for room on the rollout queue.
        self._step_started: float | None = None
        self._engine_steps = 0
        self._put_waiting_since: float | None = None
        # The weight channel to trainer rank 0 (collective transport), one transfer at a time.
        self.weight_channel = ChannelReceiver(f"collector[{worker_id}]")

    @property
    def _updates_in_flight(self) -> bool:
        """Weights are loaded between engine steps, not only between batches."""
        return self.weight_updates != "between_batches"

    @property
    def _plays_own_episodes(self) -> bool:
        """The environment runs its episodes itself and asks the engine over HTTP (verifiers)."""
        return getattr(self.environment, "supplies_tasks", False)

    @classmethod
    def as_remote(cls, **options: Any) -> Any:
        """This class as a threaded Ray actor class.

        Threads let `evaluate` through while a generation batch waits on a full rollout
        queue. Weight transfers run in the ``weights`` concurrency group and `heartbeat` in
        ``health`` (`grpo.weights.base.COLLECTOR_CONCURRENCY_GROUPS`; callers pick them with ``.options(concurrency_group=...)``), each
        on a thread of its own.

        Args:
            **options: ``ray.remote`` options (``num_cpus``, ``num_gpus``, ...);
                ``max_concurrency`` (of the default group) defaults to 4.

        Returns:
            The Ray actor class; call ``.remote(...)`` with the constructor's arguments.
        """
        import ray

        defaults = {"max_concurrency": 4, "concurrency_groups": COLLECTOR_CONCURRENCY_GROUPS}
        return ray.remote(**{**defaults, **options})(cls)

    def heartbeat(self) -> dict[str, float]:
        """What this collector is doing now, for the driver's stall watch.

        Takes no lock: it answers while a batch holds the engine (call it in the ``health``
        concurrency group).
        A frozen process does not answer at all, which the driver reads as an answer too.

        Returns:
            dict[str, float]: ``in_engine_step_s`` (how long the engine step now running has
            run; 0.0 between steps), ``engine_steps`` (steps so far), and
            ``queue_wait_s`` (how long the batch has waited for room on the rollout queue;
            0.0 when it does not wait).
        """
        now = time.monotonic()
        started, waiting = self._step_started, self._put_waiting_since
        return {
            "in_engine_step_s": now - started if started is not None else 0.0,
            "engine_steps": float(self._engine_steps),
            "queue_wait_s": now - waiting if waiting is not None else 0.0,
        }

    # ------------------------------------------------------------------ weights

    def receive_weights(
        self,
        weights: Any,
        version: int,
        checksum: str | None = None,
        probe: dict[str, Any] | None = None,
    ) -> bool:
        """Queue new weights; they are applied before the next generation batch.

        Args:
            weights: ``dict[str, Tensor]`` under HF names, or a Ray ``ObjectRef`` to one.
            version (int): Their policy version; must exceed the current one.
            checksum (str | None): `state_dict_checksum` of the weights, checked on load.
            probe (dict | None): Optional logprob check, see `WeightUpdate`.

        Returns:
            bool: False (and ignored) if the version is not newer than both the engine's and
            the pending update's.
        """
        update = WeightUpdate(version=int(version), weights=weights, checksum=checksum, probe=probe)
        accepted = self.weights.offer(update, self.policy_version)
        if not accepted:
            log.warning(
                "collector %d ignored weights of version %s: it already has version %d or newer",
                self.worker_id,
                version,
                self.policy_version,
            )
        return accepted

    def receive_weights_over_channel(
        self,
        version: int,
        specs: Sequence[TensorSpec],
        bucket_bytes: int,
        checksum: str | None = None,
        probe: dict[str, Any] | None = None,
        join: dict[str, Any] | None = None,
    ) -> bool:
        """Receive weights broadcast by trainer rank 0 (`PyTorchActorModel.send_weights`) and queue them.

        Runs in one of the actor's threads, beside generation; the received tensors (views
        into the received buckets) become a pending update like `receive_weights`'s.

        Args:
            version (int): Their policy version.
            specs (Sequence[TensorSpec]): Names, shapes and dtypes, in the sender's order.
            bucket_bytes (int): The sender's bucket size.
            checksum (str | None): `state_dict_checksum` of the weights, checked on load.
            probe (dict | None): Optional logprob check, see `WeightUpdate`.
            join (dict | None): ``{"host", "port", "device", "timeout_s"}`` of a new channel
                (`PyTorchActorModel.open_weight_channel`) to join first, replacing any old one.

        Returns:
            bool: Whether the update was kept (see `receive_weights`).

        Raises:
            WeightChannelError: No channel, or the rendezvous or a broadcast failed or timed
                out.
        """
        weights = self.weight_channel.receive(specs, bucket_bytes, join)
        return self.receive_weights(weights, version, checksum, probe)

    def apply_pending_weights(self) -> float:
        """Load pending weights, if any, into the engine and bump ``policy_version``.

        Returns:
            float: Seconds spent (0.0 if nothing was pending).

        Raises:
            WeightSyncError: If the checksum or the probe does not match, or an earlier update
                failed and no good one has arrived since. The engine then holds weights it
                cannot vouch for: generation and evaluation refuse to run (rather than label
                samples with a wrong ``policy_version``) until a verified update is applied.
        """
        with self._engine_lock:
            if self._updates_in_flight:
                return self._switch_weights()
            start = time.perf_counter()
            try:
                applied = self.weights.apply_pending(self.llm, verify=self.verify_weights)
                if applied is not None and applied.probe is not None:
                    self._check_probe(applied.probe, applied.version)
            except WeightSyncError as error:
                self._weights_error = str(error)
                raise
            if applied is None:
                if self._weights_error is not None:
                    raise WeightSyncError(
                        f"collector {self.worker_id} holds unverified weights "
                        f"({self._weights_error}); it generates again once a verified update "
                        "is applied"
                    )
                return 0.0
            self._weights_error = None
            self.policy_version = self._sampling_version = applied.version
            return time.perf_counter() - start

    def _switch_weights(self) -> float:
        """Load pending weights now, between two steps of the engine (hold the engine lock).

        The engine's running requests are preempted and prefilled again with the new weights,
        so each samples on as the new policy; the versions of the tokens each has so far are
        recorded first. An update whose checksum or probe fails is rolled back: the engine
        reloads the weights it had, keeps its version and samples on; the tokens sampled while
        the probe ran are labelled `UNVERIFIED_VERSION`, and the samples holding them are
        sampled again (`_generate_groups`, `TurnEngine`).

        With ``in_flight_keep_kv`` the running requests keep their KV cache instead; its
        blocks are then dropped from the prefix cache once the engine is idle (`_step`), so no
        later prompt reuses keys and values of the old weights.

        Returns:
            float: Seconds generation was paused (0.0 if nothing was pending).

        Raises:
            WeightSyncError: After `MAX_REJECTED_UPDATES_IN_A_ROW` rejected updates in a row.
        """
        self._drop_stale_prefix_cache()
        if not self.weights.has_pending:
            return 0.0
        start = time.perf_counter()
        running = self.llm.llm_engine.has_unfinished_requests()
        recompute = self.weight_updates != "in_flight_keep_kv"
        self._mark_token_versions()  # the tokens so far: the weights being replaced
        try:
            applied = self.weights.apply_pending(
                self.llm, verify=self.verify_weights, recompute_running=recompute
            )
            self._stale_prefix_cache = running and not recompute
            if applied is None:  # taken by another thread in between
                return 0.0
            self._sampling_version = applied.version
            if applied.probe is not None:
                self._check_probe(applied.probe, applied.version)
        except WeightSyncError as error:
            # The tokens sampled while the probe ran, by samples still running and by those
            # that finished meanwhile (held for the next `_step`), came from the rejected
            # weights.
            rejected = self._sampling_version
            self._sampling_version = UNVERIFIED_VERSION
            self._mark_token_versions()
            if rejected != self.policy_version:
                self._held_outputs = [
                    (
                        output,
                        [
                            [(UNVERIFIED_VERSION if v == rejected else v, n) for v, n in sample]
                            for sample in runs
                        ],
                    )
                    for output, runs in self._held_outputs
                ]
            if not self._can_roll_back:
                self._weights_error = str(error)
                raise WeightSyncError(
                    f"collector {self.worker_id}: {error}; the weights it had were on the GPU "
                    "and not kept, so it cannot roll back"
                ) from error
            self._restore_weights()
            self.totals["weight_updates_rejected"] += 1
            self._rejected_in_a_row += 1
            log.warning(
                "collector %d rejected new weights and keeps version %d: %s",
                self.worker_id,
                self.policy_version,
                error,
            )
            if self._rejected_in_a_row >= MAX_REJECTED_UPDATES_IN_A_ROW:
                raise WeightSyncError(
                    f"collector {self.worker_id}: {self._rejected_in_a_row} weight updates in a "
                    f"row failed verification; the last: {error}"
                ) from error
            return time.perf_counter() - start
        # Kept for a rollback where that costs no accelerator memory (on CPU a reload copies
        # them into vLLM's own packed weights anyway); a GPU copy would double the weights.
        on_cpu = all(t.device.type == "cpu" for t in applied.weights.values())
        self._loaded_weights = applied.weights if on_cpu else None
        self._can_roll_back = on_cpu
        self.policy_version = applied.version
        self._weights_error = None
        self._rejected_in_a_row = 0
        seconds = time.perf_counter() - start
        if running:
            self.totals["weight_updates_in_flight"] += 1
            self._batch_switches["updates"] += 1
            self._batch_switches["pause_s"] += seconds
        return seconds

    def _drop_stale_prefix_cache(self) -> None:
        """Reset the prefix cache if old weights' blocks are in it and the engine is idle."""
        if self._stale_prefix_cache and not self.llm.llm_engine.has_unfinished_requests():
            self._stale_prefix_cache = not self.llm.reset_prefix_cache()

    def _restore_weights(self) -> None:
        """Reload the weights of ``policy_version`` (after a rejected in-flight update)."""
        weights = self._loaded_weights
        if weights is None:  # the engine still ran the model folder's weights
            from grpo.models import load_hf_state_dict

            weights = load_hf_state_dict(self.model_dir)
        self.llm.collective_rpc("grpo_update_weights", args=(weights, True))
        self.llm.reset_prefix_cache(reset_running_requests=True)
        self._sampling_version = self.policy_version
        self._stale_prefix_cache = False

    def _mark_token_versions(self) -> None:
        """Record that every running sample's tokens so far came from ``_sampling_version``.

        Reads vLLM's output processor, which holds the sampled logprobs of each running sample
        (child ``request_index`` of the request ``external_req_id``) until it finishes.
        """
        label = self._sampling_version
        for state in self.llm.llm_engine.output_processor.request_states.values():
            count = len(state.logprobs_processor.logprobs or ())
            marks = self._token_versions.setdefault(
                (state.external_req_id, state.request_index), []
            )
            if count > (marks[-1][1] if marks else 0):
                marks.append((label, count))

    def _check_probe(self, probe: dict[str, Any], version: int) -> None:
        got = torch.tensor(self.probe_logprobs(probe["token_ids"]))
        expected = torch.tensor(probe["logprobs"], dtype=torch.float32)
        max_diff = float((got - expected).abs().max()) if got.numel() else 0.0
        if got.shape != expected.shape or max_diff > float(probe.get("atol", 1e-3)):
            raise WeightSyncError(
                f"weights of version {version}: the engine's probe logprobs differ from the "
                f"sender's by {max_diff:.3g} (atol {probe.get('atol', 1e-3)}); the engine does "
                "not compute with the sent weights"
            )

    def get_weights_checksum(self) -> str | None:
        """`state_dict_checksum` of the weights the engine was last loaded with."""
        with self._engine_lock:
            return self.llm.collective_rpc("grpo_weights_checksum")[0]

    def get_policy_version(self) -> int:
        """Version of the weights the engine holds."""
        return self.policy_version

    def probe_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """The engine's logprob of every token of ``token_ids`` after the first.

        The trainer computes the same numbers with its model to check that the engine really
        computes with the synced weights (a checksum only proves they arrived).

        Args:
            token_ids (Sequence[int]): At least two token ids.

        Returns:
            list[float]: ``len(token_ids) - 1`` logprobs, from unscaled logits.
        """
        from vllm import SamplingParams

        token_ids = [int(t) for t in token_ids]
        if len(token_ids) < 2:
            raise ValueError(f"probe_logprobs needs at least 2 token ids, got {len(token_ids)}")
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        request_id = f"probe-{next(_REQUEST_IDS)}"
        output = None
        with self._engine_lock:
            # Stepped like any request: during an in-flight update the running samples go on
            # beside it, and what finishes meanwhile is handed to the next `_step`.
            self._add_request(request_id, token_ids, params)
            while output is None:
                for finished, versions in self._engine_step():
                    if finished.request_id == request_id:
                        output = finished
                    else:
                        self._held_outputs.append((finished, versions))
        # prompt_logprobs[0] is None (nothing precedes the first token); entry i maps the
        # actual token i (and possibly the top candidates) to its logprob.
        return [
            float(entry[token].logprob)
            for token, entry in zip(token_ids[1:], output.prompt_logprobs[1:])
        ]

    # ------------------------------------------------------------------ the engine loop

    def _add_request(self, request_id: str, token_ids: Sequence[int], params: Any) -> None:
        """Add a request to the engine; its one output comes when it finishes (hold the lock)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY
        # The outputs carry this id (vLLM adds a suffix of its own only inside the engine).
        prompt = TokensPrompt(prompt_token_ids=list(token_ids))
        self.llm.llm_engine.add_request(request_id, prompt, params)

    def _step(self, load_pending: bool = True) -> list[tuple[Any, list[list[tuple[int, int]]]]]:
        """Pending weights in (updates in flight), then one step of the engine's scheduler.

        Args:
            load_pending (bool): Load pending weights first if updates are in flight.

        Returns:
            list: The requests that finished, each with the ``(version, tokens)`` runs of its
            samples' tokens (`_engine_step`), including any that finished while a probe ran.
        """
        if load_pending and self._updates_in_flight:
            self._switch_weights()
        finished, self._held_outputs = self._held_outputs, []
        return finished + self._engine_step()

    def _engine_step(self) -> list[tuple[Any, list[list[tuple[int, int]]]]]:
        """One scheduler step; each finished request with its samples' version runs."""
        finished = []
        self._step_started = time.monotonic()
        try:
            outputs = self.llm.llm_engine.step()
        finally:
            self._step_started = None
            self._engine_steps += 1
        for output in outputs:
            if output.finished:
                runs = [
                    self._version_runs(output.request_id, c.index, len(c.token_ids))
                    for c in output.outputs
                ]
                finished.append((output, runs))
        return finished

    def _version_runs(self, request_id: str, index: int, num_tokens: int) -> list[tuple[int, int]]:
        """``[(version, number of tokens), ...]`` of a finished sample, oldest first."""
        runs, start = [], 0
        for version, count in self._token_versions.pop((request_id, index), []):
            runs.append((version, count - start))
            start = count
        if num_tokens > start or not runs:
            runs.append((self._sampling_version, num_tokens - start))
        return runs

    @contextlib.contextmanager
    def _batch_in_engine(self) -> Iterator[None]:
        """Hold the engine for a batch; a batch that fails leaves no request behind (a later
        ``generate`` would otherwise run them as its own)."""
        with self._engine_lock:
            try:
                yield
            except BaseException:
                self._abort_unfinished()
                raise

    def _abort_unfinished(self) -> None:
        """Drop every request still in the engine (a batch that failed half-way)."""
        engine = self.llm.llm_engine
        request_ids = {s.external_req_id for s in engine.output_processor.request_states.values()}
        if request_ids:
            engine.abort_request(sorted(request_ids))
        self._token_versions.clear()
        self._held_outputs.clear()

    # ------------------------------------------------------------------ generation

    def _prompt_token_ids(self, item: Mapping[str, Any]) -> list[int]:
        text = item.get("prompt")
        if text is None:
            raise KeyError(
                f"example {item.get('index')} has no 'prompt' (build the dataset with a template)"
            )
        # add_eos=False: the prompt continues into the response. A plain prompt gets a bos
        # only for families whose tokenizer adds one (Llama 3); a chat template's text is
        # encoded as it is (add_bos=False), as transformers and vLLM encode it.
        return self.tokenizer.encode(text, add_bos=self.add_bos, add_eos=False)

    def _next_prompts(self, num_prompts: int) -> list[tuple[dict[str, Any], list[int]]]:
        """The next ``num_prompts`` examples of the shard that fit, with their token ids."""
        if self._plays_own_episodes:  # its client renders the prompts
            return [(item, []) for item in self.stream.next_batch(num_prompts)]
        prompts: list[tuple[dict[str, Any], list[int]]] = []
        skipped_in_a_row = 0
        while len(prompts) < num_prompts:
            [item] = self.stream.next_batch(1)
            token_ids = self._prompt_token_ids(item)
            if len(token_ids) > self.max_prompt_tokens:
                self.totals["skipped_long_prompts"] += 1
                skipped_in_a_row += 1
                if skipped_in_a_row >= len(self.stream):
                    raise ValueError(
                        f"collector {self.worker_id}: every prompt of its shard is longer than "
                        f"max_prompt_tokens={self.max_prompt_tokens}"
                    )
                continue
            skipped_in_a_row = 0
            prompts.append((item, token_ids))
        return prompts

    def _request_seed(self, group_id: int) -> int:
        # A hash of (run seed, group id): vLLM gives the n samples of a request the seeds
        # seed, ..., seed + n - 1, and the turns of a multi-turn episode hash their own from
        # those (`grpo.seeds`), so no two requests of the run share a seed.
        return group_seed(self.seed, group_id)

    def _sampling_params(
        self,
        seed: int,
        max_tokens: int,
        n: int | None = None,
        extra_stop: Sequence[str] = (),
        greedy: bool = False,
    ) -> Any:
        """The sampling of a training request: ``n`` samples (default ``group_size``) with the
        run's temperature and top-p (``greedy``: temperature 0), stopping on the template's
        stop strings, ``extra_stop`` and the model's stop tokens."""
        from vllm import SamplingParams

        return SamplingParams(
            n=self.group_size if n is None else n,
            max_tokens=max_tokens,
            temperature=0.0 if greedy else self.temperature,
            top_p=1.0 if greedy else self.top_p,
            logprobs=0,  # the sampled token's logprob only
            seed=seed,
            stop=[*self.stop_strings, *extra_stop] or None,
            include_stop_str_in_output=True,
            # torchtune's stop tokens (<|im_end|>, <|endoftext|>), in case the model folder's
            # generation_config names only one of them.
            stop_token_ids=list(self.tokenizer.stop_tokens),
        )

    @staticmethod
    def _sampled_logprobs(completion: Any, where: str) -> list[float]:
        """vLLM's logprob of each sampled token of a completion (one per token, checked)."""
        token_ids = completion.token_ids
        entries = completion.logprobs or ()
        if len(entries) != len(token_ids):
            raise RuntimeError(
                f"vLLM returned {len(entries)} logprobs for {len(token_ids)} tokens ({where})"
            )
        return [entry[token].logprob for token, entry in zip(token_ids, entries)]

    def _next_sequence_id(self) -> str:
        """``w{worker_id}-{n}``: unique across workers, in generation order."""
        sequence_id = f"w{self.worker_id}-{self.sequence_counter}"
        self.sequence_counter += 1
        return sequence_id

    def _generate_groups(
        self, prompts: list[tuple[dict[str, Any], list[int]]], group_ids: list[int]
    ) -> tuple[list[GroupedUnscoredTrajectories], int, list[list[tuple[int, int]]]]:
        """One request of ``group_size`` samples per prompt, stepped until all finish.

        Returns:
            tuple: The groups, in prompt order; how many samples hit the token limit; the
            ``(version, tokens)`` runs of every sample.
        """
        # vLLM request id -> the prompt's index; a request sampled again gets a new id.
        pending: dict[str, int] = {}
        finished: dict[int, tuple[Any, list[list[tuple[int, int]]]]] = {}

        def submit(index: int) -> None:
            request_id = f"group-{group_ids[index]}-{next(_REQUEST_IDS)}"
            seed = self._request_seed(group_ids[index])
            params = self._sampling_params(seed, self.max_generated_tokens)
            self._add_request(request_id, prompts[index][1], params)
            pending[request_id] = index

        with self._batch_in_engine():
            for index in range(len(prompts)):
                submit(index)
            while pending:
                for output, runs in self._step():
                    index = pending.pop(output.request_id)
                    if any(v == UNVERIFIED_VERSION for sample in runs for v, _ in sample):
                        submit(index)  # part of it came from weights that failed verification
                    else:
                        finished[index] = (output, runs)
        groups, truncated, all_runs = [], 0, []
        for index, ((item, ids), group_id) in enumerate(zip(prompts, group_ids)):
            output, runs = finished[index]
            groups.append(self._build_group(item, ids, group_id, output.outputs, runs))
            truncated += sum(c.finish_reason == "length" for c in output.outputs)
            all_runs += runs
        return groups, truncated, all_runs

    def _version_metrics(self, runs: list[list[tuple[int, int]]]) -> dict[str, float]:
        """Weight updates during the batch and how old the policy of its tokens is.

        Args:
            runs (list): The ``(version, tokens)`` runs of each sample of the batch.

        ``tokens_version_lag_K`` counts the sampled tokens whose weights were K versions (2:
        two or more) older than the collector's at the end of the batch.
        """
        lags = [0.0, 0.0, 0.0]
        for sample_runs in runs:
            for version, count in sample_runs:
                lags[min(max(self.policy_version - version, 0), 2)] += count
        return {
            "inference/weight_updates_in_flight": self._batch_switches["updates"],
            "inference/weight_updates_in_flight_total": self.totals["weight_updates_in_flight"],
            "inference/weight_updates_rejected": self.totals["weight_updates_rejected"],
            "inference/time_engine_paused (s)": self._batch_switches["pause_s"],
            "inference/trajectories_spanning_versions": float(
                sum(len({version for version, _ in sample_runs}) > 1 for sample_runs in runs)
            ),
            "inference/tokens_version_lag_0": lags[0],
            "inference/tokens_version_lag_1": lags[1],
            "inference/tokens_version_lag_2+": lags[2],
        }

    def _build_group(
        self,
        item: Mapping[str, Any],
        prompt_ids: list[int],
        group_id: int,
        completions: Any,
        version_runs: list[list[tuple[int, int]]],
    ) -> GroupedUnscoredTrajectories:
        prompt_tokens = torch.tensor(prompt_ids, dtype=torch.long)
        trajectories = []
        for completion, runs in zip(completions, version_runs, strict=True):
            token_ids = list(completion.token_ids)
            logprobs = torch.tensor(
                self._sampled_logprobs(completion, f"group {group_id}"), dtype=torch.float32
            )
            trajectories.append(
                UnscoredTrajectory(
                    prompt_tokens=prompt_tokens,
                    response_tokens=torch.tensor(token_ids, dtype=torch.long),
                    prompt_len=len(prompt_ids),
                    response_len=len(token_ids),
                    logprobs=logprobs,
                    answer=item["answer"],
                    sequence_id=self._next_sequence_id(),
                    policy_version=min(version for version, _ in runs),
                    group_id=group_id,
                    last_policy_version=runs[-1][0],
                )
            )
        return GroupedUnscoredTrajectories.from_trajectories(trajectories)

    def _turn_engine(self, greedy: bool = False) -> TurnEngine:
        """The engine as a continuous `grpo.envs.rollout.TurnEngine` (hold the engine lock)."""
        return TurnEngine(self, greedy)

    def _run_episodes(
        self, prompts: list[tuple[dict[str, Any], list[int]]], group_ids: list[int]
    ) -> tuple[list[GroupedUnscoredTrajectories], dict[str, float]]:
        """Multi-turn episodes of the environment for ``prompts``, scored, as groups."""
        from grpo.envs import episode_groups, run_episodes

        first_version = self.policy_version  # weights may change while the episodes run
        if self._plays_own_episodes:
            self.environment.start(
                self.model_dir,
                max_model_len=self.max_model_len,
                max_tokens=self.max_generated_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
            )
            with self._batch_in_engine():  # its turns are in the engine until the batch ends
                episodes = self.environment.run_groups(
                    [item for item, _ in prompts],
                    self._turn_engine(),
                    group_size=self.group_size,
                    max_tokens=self.max_generated_tokens,
                    seed=self._request_seed(group_ids[0]),
                )
        else:
            with self._batch_in_engine():
                episodes = run_episodes(
                    self.environment,
                    self._turn_engine(),
                    self.tokenizer,
                    self.renderer,
                    prompts,
                    group_size=self.group_size,
                    max_tokens_per_turn=self.max_generated_tokens,
                    max_model_len=self.max_model_len,
                    seeds=[self._request_seed(group_id) for group_id in group_ids],
                )
        kept = [e for group in episodes for e in group if e.error is None]
        self._batch_drops = self.dropped_episodes.record(
            [e for group in episodes for e in group], type(self.environment).__name__
        )
        dropped = self._batch_drops.dropped
        self.totals["episodes_dropped"] += dropped
        rewards = self.environment.score(kept) if kept else []

        groups = episode_groups(
            episodes,
            rewards,
            group_ids=group_ids,
            sequence_id=self._next_sequence_id,
            policy_version=first_version,
            last_policy_version=self.policy_version,
        )
        metrics = episode_metrics(kept, dropped, self.totals["episodes_dropped"])
        if self._plays_own_episodes:
            metrics["inference/episode_split_traces"] = float(self.environment.split_traces)
        return groups, metrics

    def _put_groups(self, groups: list[GroupedUnscoredTrajectories], put: dict[str, float]) -> None:
        """Blocking puts of ``groups`` in order, retried on timeout until every one is queued.

        A `RolloutQueue` takes them in one round trip (`RolloutQueue.put_all`), any other queue
        one ``put`` at a time (`_put_one_by_one`); both say how many fitted before a timeout.
        ``put["queued"]`` counts the groups queued so far (right even when a put raises),
        ``put["waits"]`` and ``put["wait_s"]`` the timeouts on a full queue and the time spent.
        """
        if self.rollout_queue is None:
            raise RuntimeError(f"collector {self.worker_id} has no rollout_queue to put groups on")
        put_all = getattr(self.rollout_queue, "put_all", self._put_one_by_one)
        start = time.perf_counter()
        self._put_waiting_since = time.monotonic()
        try:
            while (queued := int(put["queued"])) < len(groups):
                put["queued"] += put_all(groups[queued:], self.queue_put_timeout_s)
                if put["queued"] < len(groups):
                    put["waits"] += 1
                    self.totals["queue_put_waits"] += 1
        finally:
            self._put_waiting_since = None
            put["wait_s"] += time.perf_counter() - start

    def _put_one_by_one(self, groups: list[GroupedUnscoredTrajectories], timeout_s: float) -> int:
        """`RolloutQueue.put_all` for a queue with only ``put``: how many fitted before a timeout."""
        for count, group in enumerate(groups):
            try:
                self.rollout_queue.put(group, block=True, timeout=timeout_s)
            except queue.Full:  # ray.util.queue.Full subclasses queue.Full
                return count
        return len(groups)

    def generate_batch(
        self, num_prompts: int, *, caller_holds_groups: bool = False
    ) -> dict[str, float]:
        """Apply pending weights, sample ``group_size`` responses for the next prompts, queue them.

        A put that fails (e.g. the queue actor died) ends the batch with its error; the batch's
        metrics, with the groups not queued in ``inference/groups_not_queued``, are logged first.
        With ``caller_holds_groups`` a dead queue ends the batch without an error: the caller
        gets the batch's groups (`generate_batch_with_state`) and rescues those it lost.

        Args:
            num_prompts (int): Prompts to take from the shard (one group each).
            caller_holds_groups (bool): The caller keeps this batch's groups (see above).

        Returns:
            dict[str, float]: This batch's metrics (also sent to the metric logger):
            ``inference/*`` and ``queues/rollout_queue_put_*``.

        Raises:
            ValueError: If ``num_prompts`` is below 1.
            WeightSyncError: If pending weights fail verification.
        """
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        weight_update_s = (
            self.apply_pending_weights()
            if self._updates_in_flight
            or self.batch_counter % self.weight_check_every_n_batches == 0
            else 0.0
        )
        self._batch_switches = {"updates": 0.0, "pause_s": 0.0}
        prompts = self._next_prompts(num_prompts)
        group_ids = [
            self.worker_id + self.num_workers * (self.group_counter + i) for i in range(num_prompts)
        ]
        self.group_counter += num_prompts
        start = time.perf_counter()
        if self.environment is None:
            groups, truncated, runs = self._generate_groups(prompts, group_ids)
            episode_metrics: dict[str, float] = {}
        else:
            groups, episode_metrics = self._run_episodes(prompts, group_ids)
            truncated = episode_metrics["inference/episode_truncated"]
            # An episode's turns are not tracked one by one: its tokens count at its oldest
            # version, and it spans versions when the weights changed while it ran.
            runs = [
                [(t.policy_version, t.policy_len), (t.last_policy_version, 0)]
                for g in groups
                for t in g.trajectories
            ]
        generation_s = time.perf_counter() - start
        response_lens = [t.response_len for g in groups for t in g.trajectories] or [0]
        # Tokens the policy sampled (environment turns of multi-turn episodes are not).
        generated = sum(t.policy_len for g in groups for t in g.trajectories)
        self.batch_counter += 1

        self._batch_groups = groups
        put = {"waits": 0.0, "wait_s": 0.0, "queued": 0.0}
        try:
            self._put_groups(groups, put)
        except Exception as error:
            if not (caller_holds_groups and _is_dead_actor(error)):
                raise
        finally:
            queued = int(put["queued"])
            metrics = {
                "inference/worker_id": float(self.worker_id),
                "inference/policy_version": float(self.policy_version),
                "inference/num_groups": float(queued),
                "inference/groups_not_queued": float(len(groups) - queued),
                "inference/generated_tokens": float(generated),
                # Each group's prompt once (an environment's client may render its own).
                "inference/prompt_tokens": float(sum(g.trajectories[0].prompt_len for g in groups)),
                "inference/tokens_per_second": generated / max(generation_s, 1e-9),
                "inference/time_generation (s)": generation_s,
                "inference/time_weight_update (s)": weight_update_s,
                "inference/response_length_mean": sum(response_lens) / len(response_lens),
                "inference/response_length_max": float(max(response_lens)),
                "inference/truncated_fraction": truncated / len(response_lens),
                "inference/skipped_long_prompts": self.totals["skipped_long_prompts"],
                **self._version_metrics(runs),
                "queues/rollout_queue_put_wait_s": put["wait_s"],
                "queues/rollout_queue_put_waits": put["waits"],
                **episode_metrics,
            }
            if queued < len(groups):
                log.warning(
                    "collector %d: %d generated groups were not queued because a put failed",
                    self.worker_id,
                    len(groups) - queued,
                )
        return metrics

    def generate_batch_with_state(
        self, num_prompts: int
    ) -> tuple[dict[str, Any], list[GroupedUnscoredTrajectories]]:
        """`generate_batch`, then `state_dict` as it stands right after that batch.

        The orchestrator keeps the state of every collector's last finished batch: a
        replacement for a collector that died mid-batch loads it and generates that batch
        again (groups of it that had reached the queue are recognised by their ``group_id``
        and scored once). It calls this with ``num_returns=2`` and holds the second return,
        the batch's groups, without fetching it, until every group has been scored: a rollout
        queue that dies with groups in it is replaced and those groups are scored from there.
        A dead queue is therefore no error here (``inference/groups_not_queued`` counts the
        groups it did not take).

        Returns:
            tuple: ``{"metrics": generate_batch's metrics, "state": state_dict(),
            "group_ids": the batch's group ids, "dropped_episodes": the batch's episodes and
            those the environment failed (`grpo.envs.dropped.BatchDrops.as_dict`; None
            without an environment)}``, and the batch's groups.
        """
        # No lock: only generation batches move the stream, and the orchestrator runs one at
        # a time. (Holding the engine lock here would block `evaluate` for as long as the
        # batch waits on a full queue.)
        self._batch_drops = None
        metrics = self.generate_batch(num_prompts, caller_holds_groups=True)
        drops, groups = self._batch_drops, self._batch_groups
        info = {
            "metrics": metrics,
            "state": self.state_dict(),
            "group_ids": [group.group_id for group in groups],
            "dropped_episodes": drops.as_dict() if drops is not None else None,
        }
        return info, groups

    def set_rollout_queue(self, rollout_queue: Any) -> None:
        """Put the next groups onto ``rollout_queue`` (the replacement of a queue that died)."""
        self.rollout_queue = rollout_queue

    def shutdown(self) -> None:
        """Shut the vLLM engine down now (idempotent).

        In-process engines share vLLM's global distributed state: an engine shut down by the
        garbage collector tears that state down under any other engine of the process, so
        code holding several collectors in one process (tests) closes them explicitly, last
        created first.
        """
        self.weight_channel.close()
        close_environment = getattr(self.environment, "close", None)
        if close_environment is not None:
            close_environment()
        with self._engine_lock:
            llm, self.llm = self.llm, None
            if llm is not None:
                llm.llm_engine.engine_core.shutdown()

    # ------------------------------------------------------------------ evaluation

    def evaluate(
        self, dataset_items: Sequence[Mapping[str, Any]], max_generated_tokens: int | None = None
    ) -> list[str]:
        """Greedy completions of held-out examples with the current weights.

        Pending weights are applied first. Scoring is the caller's job.

        Args:
            dataset_items (Sequence[Mapping[str, Any]]): Examples with ``"prompt"`` (or
                ``"question"`` when the collector has a template).
            max_generated_tokens (int | None): Budget per completion; default the collector's.

        Returns:
            list[str]: One completion per example, decoded with the model's tokenizer like
            the reference actor decodes training responses (special tokens dropped). A prompt
            that does not fit the engine's context gets ``""``. With an environment, the
            completion is the last policy turn of a greedy episode (tool calls answered).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._plays_own_episodes:  # `grpo validate` refuses this config
            raise ValueError(
                "held-out evaluation scores eval_dataset with reward functions; a verifiers "
                "environment's taskset scores its own episodes"
            )
        self.apply_pending_weights()
        budget = max_generated_tokens or self.max_generated_tokens
        prompt_ids = [self._prompt_token_ids(item) for item in dataset_items]
        fits = [i for i, ids in enumerate(prompt_ids) if len(ids) < self.max_model_len]
        if len(fits) < len(prompt_ids):
            log.warning(
                "collector %d: %d evaluation prompts do not fit max_model_len=%d",
                self.worker_id,
                len(prompt_ids) - len(fits),
                self.max_model_len,
            )
        params = [
            SamplingParams(
                n=1,
                max_tokens=min(budget, self.max_model_len - len(prompt_ids[i])),
                temperature=0.0,
                stop=self.stop_strings or None,
                include_stop_str_in_output=True,
                stop_token_ids=list(self.tokenizer.stop_tokens),
            )
            for i in fits
        ]
        completions = [""] * len(prompt_ids)
        if fits and self.environment is not None:
            return self._evaluate_episodes(dataset_items, prompt_ids, fits, budget, completions)
        if fits:
            with self._engine_lock:
                outputs = self.llm.generate(
                    [TokensPrompt(prompt_token_ids=prompt_ids[i]) for i in fits],
                    params,
                    use_tqdm=False,
                )
            for i, output in zip(fits, outputs):
                token_ids = list(output.outputs[0].token_ids)
                completions[i] = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        return completions

    def _evaluate_episodes(
        self,
        dataset_items: Sequence[Mapping[str, Any]],
        prompt_ids: list[list[int]],
        fits: list[int],
        budget: int,
        completions: list[str],
    ) -> list[str]:
        """Greedy episodes of the environment; each one's last assistant turn is its answer."""
        from grpo.envs import run_episodes

        with self._engine_lock:
            episodes = run_episodes(
                self.environment,
                self._turn_engine(greedy=True),
                self.tokenizer,
                self.renderer,
                [(dict(dataset_items[i]), prompt_ids[i]) for i in fits],
                group_size=1,
                max_tokens_per_turn=budget,
                max_model_len=self.max_model_len,
                seeds=[0] * len(fits),
            )
        self.dropped_episodes.record((e for [e] in episodes), type(self.environment).__name__)
        for i, [episode] in zip(fits, episodes):
            completions[i] = episode.last_assistant_text() if episode.error is None else ""
        return completions

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Stream position, id counters and policy version, for an exact resume."""
        return {
            "worker_id": self.worker_id,
            "num_workers": self.num_workers,
            "stream": self.stream.state_dict(),
            "sequence_counter": self.sequence_counter,
            "group_counter": self.group_counter,
            "batch_counter": self.batch_counter,
            "policy_version": self.policy_version,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (from `state_dict`): stream position and id counters.

        ``policy_version`` is not restored: it belongs to the weights, not to the stream. The
        engine holds the weights this collector was started from (``policy_version`` of the
        constructor) until new ones are applied, and that is the version its samples carry.
        (A collector's last batch may be older than the checkpoint's weights: labelled with
        the batch's version, every new sample would look stale.)

        Raises:
            ValueError: If the state belongs to another worker layout.
        """
        for key in ("worker_id", "num_workers"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"collector state has {key}={state[key]!r} but this collector has "
                    f"{key}={getattr(self, key)!r}"
                )
        self.stream.load_state_dict(state["stream"])
        self.sequence_counter = int(state["sequence_counter"])
        self.group_counter = int(state["group_counter"])
        self.batch_counter = int(state.get("batch_counter", 0))
