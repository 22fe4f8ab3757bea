"""A collector's side of weight sync: updates received, loaded into its vLLM engine, verified,
rolled back.

Updates load between batches or, in flight, between two engine steps. Between batches, an
engine whose update failed verification refuses to generate until a verified one arrives; in
flight, it reloads the weights it had, and the tokens sampled meanwhile are labelled
`UNVERIFIED_VERSION` so that their samples are sampled again (docs/training.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from grpo.choices import WeightUpdateMode
from grpo.observability import metric_names as names
from grpo.weights import verify as checks
from grpo.weights.adapter import EngineAdapters, MergedAdapters
from grpo.weights.base import ReceivingEnd
from grpo.weights.checksum import WeightSyncError
from grpo.weights.engine import WeightReceiver, WeightUpdate
from grpo.weights.transports import receiving_end

log = logging.getLogger(__name__)

# Weights that never verify are a fault to report, not a reason to sample with ever older ones.
MAX_REJECTED_UPDATES_IN_A_ROW = 3
# Tokens sampled by weights that then failed verification; their samples are never trained on.
UNVERIFIED_VERSION = -1


def in_flight(updates: WeightUpdateMode) -> bool:
    """Weights are loaded between engine steps, not only between batches."""
    return updates != "between_batches"


class EngineWeights:
    """The weights of one collector's vLLM engine: received, loaded, verified, rolled back.

    `receive` may be called from any thread; every other method runs under the engine lock.

    Args:
        llm: The collector's ``vllm.LLM``, started with
            ``worker_extension_cls=grpo.weights.engine.WORKER_EXTENSION_CLS``.
        engine_lock: The collector's lock around its engine, which is not thread-safe.
        model_dir: The model folder the engine started from: what a rollback reloads before
            any update was kept.
        adapters: With ``training.lora``, each version is served as a LoRA adapter of its
            own; None: full weights, loaded in place.
        merged: With ``training.lora`` served merged, what folds each adapter into the base
            weights; the update then loads as full weights.
        tokens: The record of which version sampled each token (``mark(version)``,
            ``relabel(old, new)``); None: nothing records them.
    """

    def __init__(
        self,
        llm: Any,
        engine_lock: threading.RLock,
        add_request: Callable[[str, Sequence[int], Any], None],
        engine_step: Callable[[], list[Any]],
        *,
        owner: str,
        model_dir: str,
        policy_version: int,
        verify: bool = True,
        adapters: EngineAdapters | None = None,
        merged: MergedAdapters | None = None,
        tokens: Any = None,
    ) -> None:
        self.llm = llm
        self.tokens = tokens
        self.adapters = adapters
        self._lock = engine_lock
        self._add_request = add_request
        self._engine_step = engine_step
        self.owner = owner
        self.model_dir = model_dir
        self.verify = verify
        self.end: ReceivingEnd | None = None  # the transport's, built by the first receive
        # Adapters served merged arrive as adapters and load as full weights.
        self.merged = merged
        self.pending = merged.receiver() if merged is not None else WeightReceiver()
        # sampling_version differs while new weights are being verified in flight.
        self.policy_version = int(policy_version)
        self.sampling_version = self.policy_version
        self._error: str | None = None  # set while the engine holds unverified weights
        # Re-run after the engine wakes from sleep, to prove it did not wake with stale weights.
        self.current_probe: dict[str, Any] | None = None
        self.probed_version: int | None = None
        # None: roll back to the model folder's (while `_can_roll_back`).
        self._loaded_weights: Mapping[str, torch.Tensor] | None = (
            merged.initial_weights if merged is not None else None
        )
        self._can_roll_back = True
        self._rejected_in_a_row = 0
        # in_flight_keep_kv: old weights' prefix-cache blocks, dropped once the engine is idle.
        self._stale_prefix_cache = False
        self.batch_switches = {"updates": 0.0, "pause_s": 0.0}
        self.totals = {"weight_updates_in_flight": 0.0, "weight_updates_rejected": 0.0}

    def receive(
        self,
        weights: Any,
        version: int,
        checksum: str | None = None,
        probe: dict[str, Any] | None = None,
        transport: str = "object_store",
        connection: Any = None,
    ) -> bool:
        """Receive one update through ``transport`` and keep it as the pending one.

        Args:
            weights: What the trainer's sending end published.
            probe: Optional logprob check, see `WeightUpdate`.
            transport: ``weight_sync.transport``; the first receive builds its end.

        Returns:
            bool: False (the update is ignored) if the version is not newer than both the
            engine's and the pending update's.

        Raises:
            WeightChannelError: With ``collective``: no channel, or the rendezvous or a
                broadcast failed or timed out.
        """
        if self.end is None:
            self.end = receiving_end(transport, self.owner)
        received = self.end.receive(weights, connection)
        update = WeightUpdate(
            version=int(version), weights=received, checksum=checksum, probe=probe
        )
        accepted = self.pending.offer(update, self.policy_version)
        if not accepted:
            log.warning(
                "%s ignored weights of version %s: it already has version %d or newer",
                self.owner,
                version,
                self.policy_version,
            )
        return accepted

    @property
    def has_pending(self) -> bool:
        """Whether an update waits to be applied."""
        return self.pending.has_pending

    def close(self) -> None:
        """Close the transport's end (the collective transport's channel)."""
        if self.end is not None:
            self.end.close()
        if self.adapters is not None:
            self.adapters.close()

    def apply_pending(
        self,
        updates: WeightUpdateMode,
        *,
        before_probe: Callable[[WeightUpdate | None], None] | None = None,
    ) -> float:
        """Load pending weights, if any, into the engine and bump ``policy_version``.

        Args:
            updates: ``inference.weight_updates``; in flight, a failed update is rolled back.
            before_probe: Given, the engine is idle and loads between batches whatever
                ``updates`` says; the hook runs with the update loaded (or None) before the
                probe, and with nothing pending the current weights are probed again (an
                engine waking from sleep wakes its KV cache there).

        Returns:
            float: Seconds spent (0.0 if nothing was pending).

        Raises:
            WeightSyncError: Between batches, if the checksum or probe does not match, or an
                earlier update failed and no verified one has arrived since.
        """
        with self._lock:
            if self.adapters is not None:
                return self._switch_adapter(before_probe)
            if in_flight(updates) and before_probe is None:
                return self._switch(keep_kv=updates == "in_flight_keep_kv")
            start = time.perf_counter()
            try:
                applied = self.pending.apply_pending(self.llm, verify=self.verify)
                if before_probe is not None:
                    before_probe(applied)
                if applied is not None and applied.probe is not None:
                    self._check_probe(applied.probe, applied.version)
                elif applied is None and before_probe is not None and self._error is None:
                    self._probe_current()
            except WeightSyncError as error:
                self._error = str(error)
                raise
            if applied is None:
                if self._error is not None:
                    raise WeightSyncError(
                        f"{self.owner} holds unverified weights ({self._error}); it generates "
                        "again once a verified update is applied"
                    )
                return 0.0
            self._error = None
            self.policy_version = self.sampling_version = applied.version
            self.current_probe = applied.probe
            return time.perf_counter() - start

    def load_between_steps(self, updates: WeightUpdateMode) -> None:
        """With updates in flight, load pending weights before the next step (hold the lock).

        Raises:
            WeightSyncError: As `_switch`.
        """
        if not in_flight(updates):
            return
        if self.adapters is not None:
            self._switch_adapter()
        else:
            self._switch(keep_kv=updates == "in_flight_keep_kv")

    def _switch(self, keep_kv: bool) -> float:
        """Load pending weights between two engine steps; the seconds generation paused.

        Running requests are prefilled again with the new weights (``keep_kv``: they keep
        their KV cache). A failed update is rolled back (`_reject`).

        Raises:
            WeightSyncError: After `MAX_REJECTED_UPDATES_IN_A_ROW` rejections in a row, or if
                the previous weights were not kept (on the GPU).
        """
        self._drop_stale_prefix_cache()
        if not self.pending.has_pending:
            return 0.0
        start = time.perf_counter()
        running = self.llm.llm_engine.has_unfinished_requests()
        self._mark_tokens(self.sampling_version)
        try:
            applied = self.pending.apply_pending(
                self.llm, verify=self.verify, recompute_running=not keep_kv
            )
            self._stale_prefix_cache = running and keep_kv
            if applied is None:  # taken by another thread in between
                return 0.0
            self.sampling_version = applied.version
            if applied.probe is not None:
                self._check_probe(applied.probe, applied.version)
        except WeightSyncError as error:
            self._reject(error)
            return time.perf_counter() - start
        # Kept for a rollback only on CPU: a GPU copy would double the weights' memory.
        on_cpu = all(t.device.type == "cpu" for t in applied.weights.values())
        self._loaded_weights = applied.weights if on_cpu else None
        self._can_roll_back = on_cpu
        self.policy_version = applied.version
        return self._accepted(applied, start, running)

    def _switch_adapter(
        self, before_probe: Callable[[WeightUpdate | None], None] | None = None
    ) -> float:
        """Load a pending LoRA adapter for new requests; running ones keep theirs.

        A version that fails its check is discarded. Returns the seconds taken.

        Raises:
            WeightSyncError: After `MAX_REJECTED_UPDATES_IN_A_ROW` rejected updates in a row.
        """
        update = self.pending.take()
        if update is None:
            if before_probe is not None:
                before_probe(None)
                self._probe_current()
            return 0.0
        start = time.perf_counter()
        adapters = self.adapters
        running = self.llm.llm_engine.has_unfinished_requests()
        try:
            adapters.load(update.weights, update.version, update.checksum if self.verify else None)
            if before_probe is not None:
                before_probe(update)
            if update.probe is not None:
                with adapters.probing(update.version):
                    self._check_probe(update.probe, update.version)
        except WeightSyncError as error:
            adapters.discard(update.version)
            self._count_rejection(error)
            return time.perf_counter() - start
        adapters.activate(update.version)
        self.policy_version = self.sampling_version = update.version
        return self._accepted(update, start, running)

    def _accepted(self, update: WeightUpdate, start: float, running: bool) -> float:
        """Book a verified update loaded while requests ran; the seconds since ``start``."""
        self.current_probe = update.probe
        self._error = None
        self._rejected_in_a_row = 0
        seconds = time.perf_counter() - start
        if running:
            self.totals["weight_updates_in_flight"] += 1
            self.batch_switches["updates"] += 1
            self.batch_switches["pause_s"] += seconds
        return seconds

    def _count_rejection(self, error: WeightSyncError) -> None:
        """Count a rejected update the engine did not keep; raise after too many in a row."""
        self.totals["weight_updates_rejected"] += 1
        self._rejected_in_a_row += 1
        log.warning(
            "%s rejected new weights and keeps version %d: %s",
            self.owner,
            self.policy_version,
            error,
        )
        if self._rejected_in_a_row >= MAX_REJECTED_UPDATES_IN_A_ROW:
            raise WeightSyncError(
                f"{self.owner}: {self._rejected_in_a_row} weight updates in a row failed "
                f"verification; the last: {error}"
            ) from error

    def _reject(self, error: WeightSyncError) -> None:
        """Roll back a failed in-flight update and label what it sampled (may raise)."""
        rejected = self.sampling_version
        self.sampling_version = UNVERIFIED_VERSION
        self._mark_tokens(UNVERIFIED_VERSION)
        if rejected != self.policy_version and self.tokens is not None:
            self.tokens.relabel(rejected, UNVERIFIED_VERSION)
        if not self._can_roll_back:
            self._error = str(error)
            raise WeightSyncError(
                f"{self.owner}: {error}; the weights it had were on the GPU and not kept, so it "
                "cannot roll back"
            ) from error
        checks.roll_back(self.llm, self._loaded_weights, self.model_dir)
        self.sampling_version = self.policy_version
        self._stale_prefix_cache = False
        self._count_rejection(error)

    def _mark_tokens(self, version: int) -> None:
        if self.tokens is not None:
            self.tokens.mark(version)

    def _drop_stale_prefix_cache(self) -> None:
        """Reset the prefix cache if old weights' blocks are in it and the engine is idle."""
        if self._stale_prefix_cache and not self.llm.llm_engine.has_unfinished_requests():
            self._stale_prefix_cache = not self.llm.reset_prefix_cache()

    def _check_probe(self, probe: dict[str, Any], version: int) -> None:
        checks.check_probe(self.probe_logprobs(probe["token_ids"]), probe, version)
        self.probed_version = version

    def _probe_current(self) -> None:
        """Probe the weights the engine holds again (`current_probe`, if known)."""
        if self.current_probe is not None:
            self._check_probe(self.current_probe, self.policy_version)

    def checksum(self) -> str | None:
        """`state_dict_checksum` of the weights (or LoRA adapter) the engine last loaded."""
        with self._lock:
            if self.adapters is not None:
                return self.adapters.current_checksum
            if self.merged is not None:  # the adapter's, as the trainer reports it
                return self.merged.checksum(self.policy_version)
            return self.llm.collective_rpc("grpo_weights_checksum")[0]

    def probe_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """The engine's logprob of every token of ``token_ids`` after the first.

        Raises:
            ValueError: With fewer than two token ids.
        """
        with self._lock:
            return checks.probe_logprobs(self._add_request, self._engine_step, token_ids)

    def start_batch(self) -> None:
        """Count the next batch's in-flight updates from zero."""
        self.batch_switches = {"updates": 0.0, "pause_s": 0.0}

    def batch_metrics(self, runs: Sequence[Sequence[tuple[int, int]]]) -> dict[str, float]:
        """Weight updates during the batch and how old the policy of its tokens is.

        Args:
            runs: The ``(version, tokens)`` runs of each sample of the batch.

        Returns:
            dict[str, float]: The ``inference/`` update and version-lag metrics
            (docs/metrics.md).
        """
        lags = [0.0, 0.0, 0.0]
        for sample_runs in runs:
            for version, count in sample_runs:
                lags[min(max(self.policy_version - version, 0), 2)] += count
        return {
            names.INFERENCE_WEIGHT_UPDATES_IN_FLIGHT: self.batch_switches["updates"],
            "inference/weight_updates_in_flight_total": self.totals["weight_updates_in_flight"],
            names.INFERENCE_WEIGHT_UPDATES_REJECTED: self.totals["weight_updates_rejected"],
            names.INFERENCE_TIME_ENGINE_PAUSED: self.batch_switches["pause_s"],
            names.INFERENCE_TRAJECTORIES_SPANNING_VERSIONS: float(
                sum(len({version for version, _ in sample_runs}) > 1 for sample_runs in runs)
            ),
            names.INFERENCE_TOKENS_VERSION_LAG_0: lags[0],
            names.INFERENCE_TOKENS_VERSION_LAG_1: lags[1],
            names.INFERENCE_TOKENS_VERSION_LAG_2_PLUS: lags[2],
        }
