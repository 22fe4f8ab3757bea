"""The collector's vLLM engine: how it is built and sized, and how episodes sample on it.

The engine runs inside the collector's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so it
starts without a separate engine-core process and weight updates pass tensors by reference.
`EngineLoop` steps it, loading in-flight weights between steps and recording which weights
sampled each token; `VLLMTurnEngine` adds each policy turn as its own request, so a turn joins
the running batch without waiting for the others.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from grpo.choices import WeightUpdateMode
from grpo.config.sections import InferenceConfig
from grpo.weights.adapter import EngineAdapters, MergedAdapters, engine_lora_args
from grpo.weights.engine import WORKER_EXTENSION_CLS
from grpo.weights.receiver import UNVERIFIED_VERSION, EngineWeights, in_flight
from grpo.weights.verify import PROBE_ID_PREFIX
from grpo.workers.engine_sleep import EngineSleep, sleep_engine_args, sleep_level

# vLLM settings that make a CPU engine start in seconds and fit beside other processes.
CPU_ENGINE_DEFAULTS: dict[str, Any] = {
    # Compilation takes minutes on CPU; eager is fast enough.
    "enforce_eager": True,
    # float32: behaviour logprobs then match an fp32 trainer's forward; bf16 via engine_args.
    "dtype": "float32",
    # vLLM's default (a share of the NUMA node's free memory) fails when others hold memory.
    "kv_cache_memory_bytes": 512 * 2**20,
}
ENGINE_DEFAULTS: dict[str, Any] = {
    "worker_extension_cls": WORKER_EXTENSION_CLS,
    # After temperature: the loss's ratio compares the trainer's logprobs with these.
    "logprobs_mode": "processed_logprobs",
}


def engine_kwargs(
    engine_args: Mapping[str, Any] | None, seed: int, on_cpu: bool | None = None
) -> dict[str, Any]:
    """The keyword arguments for ``vllm.LLM``: defaults, then ``engine_args`` on top.

    Args:
        on_cpu: Apply `CPU_ENGINE_DEFAULTS`; default: when CUDA is unavailable.
    """
    if on_cpu is None:
        on_cpu = not torch.cuda.is_available()
    kwargs: dict[str, Any] = {"seed": seed, **ENGINE_DEFAULTS}
    if on_cpu:
        kwargs.update(CPU_ENGINE_DEFAULTS)
    kwargs.update(dict(engine_args or {}))
    return kwargs


def whole_prefills(kwargs: Mapping[str, Any], model_dir: str) -> dict[str, Any]:
    """Engine arguments that never split a prompt's prefill across steps (the CPU default).

    vLLM 0.32 rewinds the generator of a seeded request whose prefill was split, and the CPU
    generator cannot (``RuntimeError: CPU Generator does not use offset``). The step budget
    must then hold the longest sequence.

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
    """Refuse an engine that cannot preempt its running requests (vLLM < 0.11).

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


# ``[(version, number of tokens), ...]`` of each sample of a finished request, oldest first.
VersionRuns = list[list[tuple[int, int]]]


class Engine(NamedTuple):
    """A built engine, the prompt limit that fits its context, and whether it runs its model
    eagerly on CPU (`EngineLoop`'s ``dynamo_off``)."""

    llm: Any  # vllm.LLM
    max_model_len: int
    max_prompt_tokens: int
    eager_on_cpu: bool = False


def build_engine(
    model_dir: str,
    config: InferenceConfig,
    seed: int,
    response_tokens: int | None,
    lora_rank: int | None = None,
) -> Engine:
    """Start a vLLM engine for ``model_dir`` with the ``inference:`` options.

    Without ``max_model_len`` in ``engine_args`` the context is ``max_prompt_tokens`` +
    ``response_tokens`` when both are set; a null ``max_prompt_tokens`` becomes the context
    minus the response budget.

    Args:
        response_tokens: The longest response (one turn, or a whole episode); None: only the
            context bounds it.
        lora_rank: Serve LoRA adapters of this rank; None: full weights only.

    Returns:
        Engine: The engine, its ``max_model_len`` and ``max_prompt_tokens``.

    Raises:
        ValueError: If no prompt fits (``max_prompt_tokens`` + ``max_generated_tokens`` over
            the context), or in-flight updates are asked of an engine that cannot take them.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    kwargs = engine_kwargs(config.engine_args, seed)
    if lora_rank is not None:
        kwargs = {**engine_lora_args(lora_rank), **kwargs}
    max_prompt_tokens = config.max_prompt_tokens
    if "max_model_len" not in kwargs and max_prompt_tokens is not None:
        if response_tokens is not None:  # else: the model's context
            kwargs["max_model_len"] = max_prompt_tokens + response_tokens
    user_args = config.engine_args or {}
    if not torch.cuda.is_available() and "enable_chunked_prefill" not in user_args:
        kwargs.update(whole_prefills(kwargs, model_dir))
    if config.sleep_while_training:
        kwargs.update(sleep_engine_args())  # whatever engine_args say: sleeping needs it
    # vLLM's loader runs full garbage collections, each scanning every object the imports of
    # torch, transformers and vLLM left; frozen ones are skipped (and live for good anyway).
    gc.freeze()
    llm = LLM(model=model_dir, **kwargs)
    if in_flight(config.weight_updates):
        check_in_flight_updates(llm.llm_engine)
    max_model_len = int(llm.llm_engine.model_config.max_model_len)
    max_generated_tokens = config.max_generated_tokens
    if max_prompt_tokens is None:
        max_prompt_tokens = max_model_len - (response_tokens or max_generated_tokens)
    if max_prompt_tokens < 1 or max_prompt_tokens + max_generated_tokens > max_model_len:
        raise ValueError(
            f"max_prompt_tokens={max_prompt_tokens} + max_generated_tokens="
            f"{max_generated_tokens} must fit in vLLM's max_model_len={max_model_len}"
        )
    eager_on_cpu = not torch.cuda.is_available() and bool(kwargs.get("enforce_eager"))
    return Engine(llm, max_model_len, max_prompt_tokens, eager_on_cpu)


class Sampling(NamedTuple):
    """How the run samples: the settings every policy turn shares.

    Args:
        stop: The prompt template's stop strings (kept in the turn).
        stop_token_ids: The tokenizer's stop tokens, in case the model folder's
            generation_config names only one.
    """

    temperature: float
    top_p: float
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    def params(
        self, seed: int, max_tokens: int, extra_stop: Sequence[str] = (), greedy: bool = False
    ) -> Any:
        """``SamplingParams`` of one turn (``greedy``: temperature 0, for evaluation)."""
        from vllm import SamplingParams

        stop = [*self.stop, *extra_stop]
        return SamplingParams(
            n=1,
            max_tokens=max_tokens,
            temperature=0.0 if greedy else self.temperature,
            top_p=1.0 if greedy else self.top_p,
            logprobs=0,  # the sampled token's logprob only
            # Three flat lists per sample instead of a dict and a Logprob object per token:
            # 5% of a small model's generation on CPU, and less for the garbage collector.
            flat_logprobs=True,
            seed=seed,
            stop=stop or None,
            include_stop_str_in_output=True,
            stop_token_ids=list(self.stop_token_ids),
            # Only the tokens are read; vLLM decodes text token by token (~10% of a tiny
            # model's generation on CPU) only to find stop strings in it.
            detokenize=bool(stop),
        )


def sampled_logprobs(completion: Any, where: str) -> list[float]:
    """vLLM's logprob of each sampled token of a completion (one per token, checked).

    The completion's logprobs are FlatLogprobs (`Sampling.params` asks for ``flat_logprobs``),
    whose first entry at each position is the sampled token's.

    Raises:
        RuntimeError: If vLLM returned another number of logprobs than tokens, or entries of
            other tokens.
    """
    token_ids = list(completion.token_ids)
    entries = completion.logprobs
    starts = entries.start_indices if entries is not None else []
    if len(starts) != len(token_ids):
        raise RuntimeError(
            f"vLLM returned {len(starts)} logprobs for {len(token_ids)} tokens ({where})"
        )
    if [entries.token_ids[start] for start in starts] != token_ids:
        raise RuntimeError(f"vLLM's logprobs are not those of the sampled tokens ({where})")
    return [entries.logprobs[start] for start in starts]


def add_request(
    llm: Any, request_id: str, token_ids: Sequence[int], params: Any, lora_request: Any = None
) -> None:
    """Add a request to ``llm``'s engine; its one output comes when it finishes.

    ``lora_request``: the LoRA adapter it samples with to its end (None: the base weights).
    """
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.FINAL_ONLY
    # The outputs carry this id (vLLM adds a suffix of its own only inside the engine).
    llm.llm_engine.add_request(
        request_id,
        TokensPrompt(prompt_token_ids=list(token_ids)),
        params,
        lora_request=lora_request,
    )


_TURN_IDS = itertools.count()  # request ids of policy turns, unique in the process


class VLLMTurnEngine:
    """A collector's vLLM engine as a continuous `grpo.envs.rollout.TurnEngine`.

    The caller holds the collector's engine lock from the first submit to the last step: a
    ``generate`` call in between would run these requests to completion as its own.

    Args:
        step: ``step(load_pending)``: the finished requests with their version runs.
        greedy: Temperature 0 (evaluation).
        hold_weights: Keep the weights the episodes started with; None: as ``greedy``.
    """

    def __init__(
        self,
        add_request: Callable[[str, Sequence[int], Any], None],
        step: Callable[[bool], list[tuple[Any, VersionRuns]]],
        sampling: Sampling,
        greedy: bool = False,
        max_tokens: int | None = None,
        hold_weights: bool | None = None,
    ) -> None:
        self._add_request = add_request
        self._step = step
        self.sampling = sampling
        self.greedy = greedy
        self.max_tokens = max_tokens
        self.hold_weights = greedy if hold_weights is None else hold_weights
        # A turn sampled partly by weights that failed verification is resubmitted under a new id.
        self._running: dict[str, tuple[str, Any]] = {}

    def submit(self, request: Any, key: str | None = None) -> str:
        """Start sampling a `grpo.envs.SampleRequest`; its key."""
        max_tokens = request.max_tokens
        if self.max_tokens is not None:
            max_tokens = min(max_tokens, self.max_tokens)
        params = self.sampling.params(request.seed, max_tokens, request.stop, self.greedy)
        request_id = f"turn-{next(_TURN_IDS)}"
        self._add_request(request_id, request.token_ids, params)
        self._running[request_id] = (key or request_id, request)
        return request_id

    def step(self) -> list[tuple[str, Any]]:
        """One step of the engine; the turns that finished, as `grpo.envs.Sample`s by key."""
        from grpo.envs import Sample

        finished = []
        for output, runs in self._step(not self.hold_weights):
            if output.request_id not in self._running:
                continue
            key, request = self._running.pop(output.request_id)
            [completion] = output.outputs
            [turn_runs] = runs
            if any(version == UNVERIFIED_VERSION for version, _ in turn_runs):
                self.submit(request, key)  # part of it came from weights that failed
                continue
            sample = Sample(
                list(completion.token_ids),
                sampled_logprobs(completion, "policy turn"),
                completion.finish_reason or "stop",
                tuple(turn_runs),
            )
            finished.append((key, sample))
        return finished


class TokenVersions:
    """Which weights sampled each token of the engine's samples.

    Before an in-flight switch every running sample's tokens so far are marked with the
    version being replaced; requests that finish while a probe steps the engine are held for
    the next step.
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._marks: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self._held: list[tuple[Any, VersionRuns]] = []

    def mark(self, version: int) -> None:
        """Record that every running sample's unmarked tokens so far came from ``version``."""
        for state in self.llm.llm_engine.output_processor.request_states.values():
            count = len(state.logprobs_processor.logprobs or ())
            marks = self._marks.setdefault((state.external_req_id, state.request_index), [])
            if count > (marks[-1][1] if marks else 0):
                marks.append((version, count))

    def runs(self, request_id: str, completion: Any, version: int) -> list[tuple[int, int]]:
        """``[(version, number of tokens), ...]`` of a finished sample, oldest first; its
        tokens since the last mark are ``version``'s."""
        runs, start = [], 0
        num_tokens = len(completion.token_ids)
        for marked, count in self._marks.pop((request_id, completion.index), []):
            runs.append((marked, count - start))
            start = count
        if num_tokens > start or not runs:
            runs.append((version, num_tokens - start))
        return runs

    def hold(self, finished: list[tuple[Any, VersionRuns]]) -> None:
        """Keep finished requests for the next step."""
        self._held.extend(finished)

    def take_held(self) -> list[tuple[Any, VersionRuns]]:
        """The requests held since the last step (no longer held)."""
        held, self._held = self._held, []
        return held

    def relabel(self, old: int, new: int) -> None:
        """In the held requests' runs, tokens of ``old`` become ``new``'s."""
        self._held = [
            (output, [[(new if v == old else v, n) for v, n in sample] for sample in runs])
            for output, runs in self._held
        ]

    def clear(self) -> None:
        """Forget every request (after they were aborted)."""
        self._marks.clear()
        self._held.clear()


def _dynamo_off() -> contextlib.AbstractContextManager:
    """TorchDynamo off while it is open: compiled functions run as plain Python."""
    return torch._dynamo.config.patch(disable=True)


class EngineLoop:
    """A collector's engine with its weights: one lock, and every step timed.

    vLLM's engine is not thread-safe: every call on it holds ``lock``. Steps are timed for
    the driver's stall watch (`step_running_s`).

    Args:
        model_dir: The folder the engine was started from (what a rollback reloads).
        policy_version: The version of those weights.
        adapters: With ``training.lora``, one adapter per policy version.
        merged: With ``training.lora`` served merged, what folds each adapter into the base.
        dynamo_off: Step with TorchDynamo off (`Engine.eager_on_cpu`): such an engine compiles
            no model, but vLLM's sampler would ``torch.compile`` a helper on the first step
            (the sampled token's rank), seconds of tracing and a C++ build in every process.
    """

    def __init__(
        self,
        llm: Any,
        sampling: Sampling,
        weight_updates: WeightUpdateMode,
        *,
        owner: str,
        model_dir: str,
        policy_version: int,
        verify: bool = True,
        adapters: EngineAdapters | None = None,
        merged: MergedAdapters | None = None,
        sleep_while_training: bool = False,
        dynamo_off: bool = False,
    ) -> None:
        self.llm = llm
        self.sampling = sampling
        self._step_context = _dynamo_off if dynamo_off else contextlib.nullcontext
        self.weight_updates = weight_updates
        self.lock = threading.RLock()
        self.tokens = TokenVersions(llm)
        self.weights = EngineWeights(
            llm,
            self.lock,
            self.add_request,
            self._probe_step,
            owner=owner,
            model_dir=model_dir,
            policy_version=policy_version,
            verify=verify,
            adapters=adapters,
            merged=merged,
            tokens=self.tokens,
        )
        # With LoRA, served either way, the engine keeps its weights while asleep.
        lora = adapters is not None or merged is not None
        self.sleeper = (
            EngineSleep(llm, self.weights, self.lock, sleep_level(lora), owner)
            if sleep_while_training
            else None
        )
        self._step_started: float | None = None  # when the step now running began
        self.steps = 0

    def apply_pending(self) -> float:
        """Load pending weights now, waking a sleeping engine first; the seconds it took."""
        if self.sleeper is not None:
            load = functools.partial(self.weights.apply_pending, self.weight_updates)
            return self.sleeper.apply_pending(load)
        return self.weights.apply_pending(self.weight_updates)

    def sleep(self) -> dict[str, float]:
        """Put the engine to sleep while the trainer steps (`EngineSleep.sleep`).

        Raises:
            RuntimeError: If it was not built to sleep (``inference.sleep_while_training``).
        """
        if self.sleeper is None:
            raise RuntimeError("the engine sleeps only with inference.sleep_while_training")
        return self.sleeper.sleep()

    @property
    def in_flight(self) -> bool:
        """Whether pending weights load between engine steps, not only between batches."""
        return in_flight(self.weight_updates)

    def add_request(self, request_id: str, token_ids: Sequence[int], params: Any) -> None:
        """Add a request to the engine (hold the lock), with the adapter it samples with."""
        adapters = self.weights.adapters
        lora_request = adapters.request_added(request_id) if adapters is not None else None
        add_request(self.llm, request_id, token_ids, params, lora_request)

    def step(self, load_pending: bool = True) -> list[tuple[Any, VersionRuns]]:
        """Pending in-flight weights in (if ``load_pending``), then one step (hold the lock).

        Returns:
            list: The requests that finished, each with the ``(version, tokens)`` runs of its
            samples' tokens, including any that finished while a probe ran.

        Raises:
            WeightSyncError: As `EngineWeights.load_between_steps`.
        """
        if load_pending:
            self.weights.load_between_steps(self.weight_updates)
        return self.tokens.take_held() + self._versioned_step()

    def _probe_step(self) -> list[Any]:
        """One step while a probe runs; the other requests that finish wait for `step`."""
        finished = self._versioned_step()
        probes = [o for o, _ in finished if o.request_id.startswith(PROBE_ID_PREFIX)]
        self.tokens.hold([(o, runs) for o, runs in finished if o not in probes])
        return probes

    def _versioned_step(self) -> list[tuple[Any, VersionRuns]]:
        """One scheduler step; each finished request with its samples' version runs."""
        weights, finished = self.weights, []
        for output in self._timed_step():
            if not output.finished:
                continue
            if weights.adapters is None:
                version = weights.sampling_version
                runs = [self.tokens.runs(output.request_id, c, version) for c in output.outputs]
            else:  # every token of a request is its adapter's version
                version = weights.adapters.version_of(output.request_id)
                weights.adapters.request_finished(output.request_id)
                label = weights.policy_version if version is None else version
                runs = [[(label, len(c.token_ids))] for c in output.outputs]
            finished.append((output, runs))
        return finished

    def _timed_step(self) -> list[Any]:
        self._step_started = time.monotonic()
        try:
            with self._step_context():
                return self.llm.llm_engine.step()
        finally:
            self._step_started = None
            self.steps += 1

    def step_running_s(self, now: float) -> float:
        """How long the step now running has run (0.0 between steps); takes no lock."""
        started = self._step_started
        return now - started if started is not None else 0.0

    def turn_engine(
        self, greedy: bool = False, max_tokens: int | None = None, temperature: float | None = None
    ) -> VLLMTurnEngine:
        """The engine as the environments drive it (hold the lock while it runs).

        Args:
            greedy: Greedy turns, on the weights the episodes started with.
            temperature: Evaluation's temperature (0: greedy), on the weights the episodes
                started with; None: the run's sampling.
        """
        sampling, hold_weights = self.sampling, greedy
        if temperature is not None:
            greedy, hold_weights = temperature == 0, True
            sampling = sampling._replace(temperature=float(temperature))
        return VLLMTurnEngine(
            self.add_request, self.step, sampling, greedy, max_tokens, hold_weights
        )

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Hold the engine for a batch; a failed batch aborts its requests, or the next would
        step them as its own."""
        with self.lock:
            if self.sleeper is not None and self.sleeper.asleep:
                self.apply_pending()  # a batch with no weight check wakes the engine too
            try:
                yield
            except BaseException:
                self._abort_unfinished()
                raise

    def _abort_unfinished(self) -> None:
        engine = self.llm.llm_engine
        request_ids = {s.external_req_id for s in engine.output_processor.request_states.values()}
        if request_ids:
            engine.abort_request(sorted(request_ids))
        self.tokens.clear()
        if self.weights.adapters is not None:
            self.weights.adapters.forget_requests()

    def shutdown(self) -> None:
        """Close the weights' channels and shut the engine down (idempotent)."""
        self.weights.close()
        with self.lock:
            llm, self.llm = self.llm, None
            if llm is not None:
                llm.llm_engine.engine_core.shutdown()
