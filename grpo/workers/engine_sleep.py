"""Time-sharing one GPU with the trainer: the collector's vLLM engine sleeps while the trainer
steps and wakes for generation (``inference.sleep_while_training``, synchronous runs only).

Level 1 with LoRA (``training.lora``): vLLM moves the base weights to host memory and brings
them back on wake; only the adapters change. Level 2 with full fine-tuning: vLLM drops the
weights (copying them out would be wasted: the trainer sends new ones) and the wake loads them.
One sleep and wake, as `EngineSleep.events` records it::

    sleep(2)          before the trainers step (the driver asks: `SleepMethods.sleep_engine`)
                      ... the trainers step; the synced weights wait as the pending update ...
    wake(weights)     at the next batch or weight check (`EngineSleep.wake`)
    load(v3)          the pending update, its checksum checked (`EngineWeights.apply_pending`);
                      reload(v2) at level 2 with nothing pending: the weights it had
    wake(kv_cache)
    probe(v3)         the trainer's probe logprobs of v3, which need the KV cache: last

Every wake ends with a probe, also when nothing new was loaded: an engine can wake serving
stale or garbage weights (TRL issue 5313), which a checksum of the bytes sent cannot see. The
probe of the weights the engine holds is kept for that (`EngineWeights.current_probe`); before
the first update there is none from the trainer, and the engine records its own logprobs of
the probe tokens before it first sleeps, which it must reproduce once awake.

Level 2 with nothing pending (``weight_sync.every_n_steps`` above 1, an evaluation between
two syncs, a transfer that was ignored): vLLM kept nothing, so the last update loaded stays in
host memory (as the update arrived, or a host copy of one that arrived on the GPU: the host
memory a level-1 sleep would take) and is loaded again; before any update, the model folder
is. Requiring ``every_n_steps: 1`` instead would still leave an engine with no weights after a
transfer that failed or was ignored, and would forbid spreading the sync's cost over steps.

On CPU vLLM's ``sleep`` and ``wake_up`` only log "sleep mode is not supported on CPU", but its
engine keeps their bookkeeping (the scheduler stays paused until every tag is awake), so the
whole sequence runs, and is tested, there.
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

if TYPE_CHECKING:
    from grpo.weights.engine import WeightUpdate
    from grpo.weights.receiver import EngineWeights

log = logging.getLogger(__name__)

# vLLM's sleep levels: 1 moves the weights to host memory and back, 2 drops them.
LEVEL_KEEP_WEIGHTS = 1
LEVEL_DROP_WEIGHTS = 2
# Events kept (five per step): plenty for a test or a debugging session, bounded for a long run.
MAX_EVENTS = 1000

# ``load_and_verify(before_probe=hook)``: `EngineWeights.apply_pending` for between batches:
# load the pending update, if any, call the hook with it (or None), then run the probe.
LoadAndVerify = Callable[..., float]


def sleep_level(lora: bool) -> int:
    """The sleep level of a run: 1 with LoRA adapters (the frozen base weights come back
    from host memory), 2 with full fine-tuning (the weights are replaced on wake anyway)."""
    return LEVEL_KEEP_WEIGHTS if lora else LEVEL_DROP_WEIGHTS


def sleep_engine_args(on_cpu: bool | None = None) -> dict[str, Any]:
    """``vllm.LLM`` arguments of an engine that sleeps.

    Args:
        on_cpu (bool | None): Whether the engine runs on CPU; default: when CUDA is unavailable.

    Returns:
        dict[str, Any]: ``enable_sleep_mode`` on a GPU (its weights and KV cache then come from
        vLLM's allocator that can release them); nothing on CPU, where vLLM refuses the option
        and its ``sleep`` and ``wake_up`` do nothing.
    """
    if on_cpu is None:
        on_cpu = not torch.cuda.is_available()
    return {} if on_cpu else {"enable_sleep_mode": True}


class EngineSleep:
    """Puts a collector's engine to sleep and wakes it, loading and probing its weights.

    Every method takes the engine lock: no batch runs while the engine sleeps or wakes.

    Args:
        llm: The collector's ``vllm.LLM``.
        weights (EngineWeights): The engine's weights (pending update, probe, version).
        lock (threading.RLock): The collector's engine lock.
        level (int): vLLM's sleep level (`sleep_level`).
        owner (str): The collector's name, in errors and log lines.
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
        # Every call on the engine, in order: "sleep(2)", "wake(weights)", "load(v3)", ...
        self.events: deque[str] = deque(maxlen=MAX_EVENTS)
        self.asleep = False  # until a wake ended with a probe that passed
        self._sleeping_tags: set[str] = set()
        self._slept_at = 0.0
        # Level 2: the last verified update's weights in host memory, for a wake with nothing
        # pending (None: the model folder's, before any update).
        self._host_weights: Mapping[str, torch.Tensor] | None = None
        self._loading: WeightUpdate | None = None  # loaded by the current call, not yet probed
        self._failed: str | None = None  # why the last wake failed, until one succeeds
        # The last wake's seconds asleep and seconds to wake, for the next `sleep` to return.
        self._last_cycle: dict[str, float] = {}

    def sleep(self) -> dict[str, float]:
        """Put the engine to sleep (nothing if it sleeps already).

        Returns:
            dict[str, float]: The previous sleep's ``inference/time_asleep (s)`` and
            ``inference/time_to_wake (s)`` (empty the first time): it ended with the wake
            before the batch just trained on, so the driver logs it now.
        """
        with self._lock:
            if self.asleep:
                return {}
            if self.weights.current_probe is None:
                # No probe from the trainer yet: what the engine computes now, which it must
                # compute again once awake.
                self.weights.current_probe = self._own_probe()
            self.llm.sleep(level=self.level)
            self._sleeping_tags = {"weights", "kv_cache"}
            self.events.append(f"sleep({self.level})")
            self.asleep = True
            self._slept_at = time.monotonic()
            cycle, self._last_cycle = self._last_cycle, {}
            return cycle

    def apply_pending(self, load_and_verify: LoadAndVerify) -> float:
        """Load pending weights now: a sleeping engine wakes first (`wake`); an awake one loads
        them as usual, and at level 2 keeps them for the next wake.

        Args:
            load_and_verify (LoadAndVerify): `EngineWeights.apply_pending` of the collector's
                ``inference.weight_updates``.

        Returns:
            float: The seconds it took.

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

        Args:
            load_and_verify (LoadAndVerify): `EngineWeights.apply_pending`, which calls its
                ``before_probe`` hook between the load and the probe.

        Returns:
            float: Seconds the wake took, loads and probe included.

        Raises:
            WeightSyncError: A checksum or the probe does not match, naming the version. The
                engine then stays marked asleep: each batch tries to wake it again, and fails
                until a verified update comes, rather than sample with weights nobody vouched
                for.
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
        """The pending update (if any) in, the KV cache awake, then the probe; at level 2 the
        update's weights are kept once it passed."""
        self.weights.probed_version = None
        self._loading = None
        try:
            load_and_verify(before_probe=self._loaded)
            if self.weights.probed_version is None and self.weights.current_probe is not None:
                # The update was rejected (a LoRA adapter: the engine serves the previous one
                # on): probe what it serves.
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
        """`EngineWeights.apply_pending`'s hook between the load and the probe, which needs
        the KV cache."""
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
        # The checksum each worker computed when it first loaded them (from the model folder's
        # files before any update): what it loads now must hash the same. None: they were
        # loaded with verification off, and there is nothing to compare.
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
        token_ids = [(7 * i + 3) % min(vocab_size, 256) for i in range(16)]
        logprobs = self.weights.probe_logprobs(token_ids)
        # The same engine and weights: only the order of floating-point sums may differ.
        return {"token_ids": token_ids, "logprobs": logprobs, "atol": 1e-3}


def _on_host(weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``weights`` as they are when in host memory (kept, not copied), else a host copy."""
    if all(tensor.device.type == "cpu" for tensor in weights.values()):
        return weights
    return {name: tensor.to("cpu") for name, tensor in weights.items()}


class SleepMethods:
    """The collector's actor methods of time-sharing (mixed into `SyncLLMCollector`, whose
    ``engine`` is a `grpo.workers.vllm_engine.EngineLoop`)."""

    engine: Any

    def sleep_engine(self) -> dict[str, float]:
        """Put the engine to sleep while the trainers step (`EngineSleep.sleep`); it wakes
        for the next batch or weight check. Returns the previous sleep's metrics."""
        return self.engine.sleep()

    def engine_sleep_events(self) -> list[str]:
        """Every sleep, wake, load and probe so far, in order (`EngineSleep.events`)."""
        sleeper = self.engine.sleeper
        return list(sleeper.events) if sleeper is not None else []
