"""Time-sharing one GPU with the trainer: the collector's vLLM engine sleeps while the trainer
steps and wakes for generation (``inference.sleep_while_training``; docs/gpus-and-clusters.md).

A wake brings the weights' memory back, loads the pending update (level 2 with nothing
pending: the weights it had, kept in host memory), wakes the KV cache, then always probes:
an engine can wake serving stale or garbage weights (TRL issue 5313) that no checksum of the
bytes sent sees.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from grpo.observability import metric_names as names
from grpo.weights.checksum import WeightSyncError
from grpo.weights.verify import FP32_PROBE_TOLERANCE, probe_token_ids

if TYPE_CHECKING:
    from grpo.weights.engine import WeightUpdate
    from grpo.weights.receiver import EngineWeights

log = logging.getLogger(__name__)

# vLLM's sleep levels: 1 moves the weights to host memory and back, 2 drops them.
LEVEL_KEEP_WEIGHTS = 1
LEVEL_DROP_WEIGHTS = 2
# Five events per step: plenty for a test or a debugging session, bounded for a long run.
MAX_EVENTS = 1000

# `EngineWeights.apply_pending`, called as ``load_and_verify(before_probe=hook)``.
LoadAndVerify = Callable[..., float]


def sleep_level(lora: bool) -> int:
    """1 with LoRA (the frozen base comes back from host memory), 2 with full fine-tuning
    (the weights are replaced on wake anyway)."""
    return LEVEL_KEEP_WEIGHTS if lora else LEVEL_DROP_WEIGHTS


def sleep_engine_args(on_cpu: bool | None = None) -> dict[str, Any]:
    """``vllm.LLM`` arguments of an engine that sleeps: none on CPU, where vLLM refuses them.

    ``on_cpu`` defaults to whether CUDA is unavailable.
    """
    if on_cpu is None:
        on_cpu = not torch.cuda.is_available()
    return {} if on_cpu else {"enable_sleep_mode": True}


class EngineSleep:
    """Puts a collector's engine to sleep and wakes it, loading and probing its weights.

    Every method takes the engine lock: no batch runs while the engine sleeps or wakes.

    Args:
        weights: The engine's weights (pending update, probe, version).
        level: vLLM's sleep level (`sleep_level`).
    """

    def __init__(
        self,
        llm: Any,
        weights: EngineWeights,
        lock: threading.RLock,
        level: int,
        owner: str,
    ) -> None:
        self.llm = llm
        self.weights = weights
        self._lock = lock
        self.level = level
        self.owner = owner
        self.events: deque[str] = deque(maxlen=MAX_EVENTS)
        self.asleep = False  # until a wake ended with a probe that passed
        self._sleeping_tags: set[str] = set()
        self._slept_at = 0.0
        # Level 2: reloaded by a wake with nothing pending (None: the model folder's).
        self._host_weights: Mapping[str, torch.Tensor] | None = None
        self._loading: WeightUpdate | None = None  # loaded by the current call, not yet probed
        self._failed: str | None = None  # why the last wake failed, until one succeeds
        self._last_cycle: dict[str, float] = {}

    def sleep(self) -> dict[str, float]:
        """Put the engine to sleep (nothing if it sleeps already).

        Returns:
            dict[str, float]: The previous sleep's time asleep and time to wake (empty the
            first time), for the driver to log.
        """
        with self._lock:
            if self.asleep:
                return {}
            if self.weights.current_probe is None:
                # No probe from the trainer yet: the engine must reproduce its own once awake.
                self.weights.current_probe = self._own_probe()
            self.llm.sleep(level=self.level)
            self._sleeping_tags = {"weights", "kv_cache"}
            self.events.append(f"sleep({self.level})")
            self.asleep = True
            self._slept_at = time.monotonic()
            cycle, self._last_cycle = self._last_cycle, {}
            return cycle

    def apply_pending(self, load_and_verify: LoadAndVerify) -> float:
        """Load pending weights now, waking a sleeping engine first.

        Args:
            load_and_verify: `EngineWeights.apply_pending` of the collector's
                ``inference.weight_updates``.

        Raises:
            WeightSyncError: As `wake`, or as `EngineWeights.apply_pending`.
        """
        with self._lock:
            if self.asleep:
                return self.wake(load_and_verify)
            if not self.weights.has_pending:
                return load_and_verify()
            start = time.monotonic()
            self._load(load_and_verify)
            return time.monotonic() - start

    def wake(self, load_and_verify: LoadAndVerify) -> float:
        """Wake the engine: weights, the new weights (or the ones it had), KV cache, probe.

        Returns:
            float: Seconds the wake took, loads and probe included.

        Raises:
            WeightSyncError: A checksum or the probe does not match. The engine stays asleep,
                and each batch fails to wake it until a verified update comes.
        """
        with self._lock:
            start = time.monotonic()
            asleep_s = start - self._slept_at
            self._wake("weights")
            try:
                if self._failed is not None and not self.weights.has_pending:
                    raise WeightSyncError(
                        f"{self.owner} holds unverified weights ({self._failed}); it wakes "
                        "once a verified update is applied"
                    )
                if self.level == LEVEL_DROP_WEIGHTS and not self.weights.has_pending:
                    self._reload()
                self._load(load_and_verify)
            except WeightSyncError as error:
                self.events.append("wake failed")
                self._failed = self._failed or str(error)
                log.warning("%s could not wake: %s", self.owner, error)
                raise
            self.asleep = False
            seconds = time.monotonic() - start
            self._last_cycle = {
                names.INFERENCE_TIME_ASLEEP: asleep_s,
                names.INFERENCE_TIME_TO_WAKE: seconds,
            }
            log.debug(
                "%s woke in %.2f s after %.1f s asleep: %s",
                self.owner,
                seconds,
                asleep_s,
                " ".join(list(self.events)[-5:]),
            )
            return seconds

    def _load(self, load_and_verify: LoadAndVerify) -> None:
        """Load the pending update (if any), wake the KV cache, probe; level 2 keeps it on host."""
        self.weights.probed_version = None
        self._loading = None
        try:
            load_and_verify(before_probe=self._loaded)
            if self.weights.probed_version is None and self.weights.current_probe is not None:
                # A rejected LoRA adapter: probe the previous one, which the engine serves on.
                self._loading = None
                load_and_verify(before_probe=self._loaded)
        except WeightSyncError as error:
            self._failed = self._failed or str(error)
            raise
        self._failed = None
        version = self.weights.probed_version
        if version is None:
            self.events.append("probe(none)")
            log.warning("%s has no probe to check its weights against", self.owner)
        else:
            self.events.append(f"probe(v{version})")
        if self.level == LEVEL_DROP_WEIGHTS and self._loading is not None:
            self._host_weights = _on_host(self._loading.weights)
        self._loading = None

    def _wake(self, tag: str) -> None:
        if tag in self._sleeping_tags:
            self.llm.wake_up(tags=[tag])
            self._sleeping_tags.discard(tag)
            self.events.append(f"wake({tag})")

    def _loaded(self, update: WeightUpdate | None) -> None:
        """The hook between the load and the probe, which needs the KV cache."""
        if update is not None:
            self._loading = update
            self.events.append(f"load(v{update.version})")
        self._wake("kv_cache")

    def _reload(self) -> None:
        """Level 2 with nothing pending: load the weights of the current version again.

        Raises:
            WeightSyncError: The workers' checksum of them is not the one they had for them.
        """
        weights = self._host_weights
        if weights is None:  # no update yet: the model folder's
            from grpo.models import load_hf_state_dict

            weights = load_hf_state_dict(self.weights.model_dir)
        version = self.weights.policy_version
        # None: first loaded with verification off, nothing to compare.
        expected = self.llm.collective_rpc("grpo_weights_checksum")
        compute = None not in expected
        got = self.llm.collective_rpc("grpo_update_weights", args=(weights, compute))
        self.events.append(f"reload(v{version})")
        if compute and got != expected:
            raise WeightSyncError(
                f"weights of version {version}: {self.owner} reloaded them after sleeping and "
                f"its workers hashed {got}, not {expected}"
            )

    def _own_probe(self) -> dict[str, Any]:
        """The engine's logprobs of a fixed sequence (the trainer's probe tokens)."""
        vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        token_ids = probe_token_ids(vocab_size)
        logprobs = self.weights.probe_logprobs(token_ids)
        # The same engine and weights: only the order of floating-point sums may differ.
        return {"token_ids": token_ids, "logprobs": logprobs, **FP32_PROBE_TOLERANCE._asdict()}


def _on_host(weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``weights`` as they are when in host memory (kept, not copied), else a host copy."""
    if all(tensor.device.type == "cpu" for tensor in weights.values()):
        return weights
    return {name: tensor.to("cpu") for name, tensor in weights.items()}


class SleepMethods:
    """The collector's actor methods of time-sharing (mixed into `SyncLLMCollector`)."""

    engine: Any

    def sleep_engine(self) -> dict[str, float]:
        """Put the engine to sleep while the trainers step; the previous sleep's metrics."""
        return self.engine.sleep()

    def engine_sleep_events(self) -> list[str]:
        """Every sleep, wake, load and probe so far, in order (`EngineSleep.events`)."""
        sleeper = self.engine.sleeper
        return list(sleeper.events) if sleeper is not None else []
