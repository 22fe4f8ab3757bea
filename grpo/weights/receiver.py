"""A collector's side of weight sync: updates received, loaded into its vLLM engine, verified
(`grpo.weights.verify`), rolled back.

`EngineWeights` is the receiving side inside a collector (`SyncLLMCollector` holds one, through
its `grpo.workers.vllm_engine.EngineLoop`). Whichever transport brought an update (its
`ReceivingEnd`, `grpo.weights.transports`), the update becomes the pending `WeightUpdate`,
loaded:

* between batches (``inference.weight_updates: between_batches``); or
* in flight, between two steps of the engine's scheduler while a batch generates
  (``in_flight``: the running requests are preempted and prefilled again with the new weights,
  so every later token is the new policy's; ``in_flight_keep_kv``: they keep the KV cache the
  old weights computed, whose blocks leave the prefix cache once the engine is idle).

Every update is verified: the checksum of the tensors the worker loaded, and the engine's
logprobs of the trainer's probe sequence. Between batches, an engine that failed refuses to
generate until a verified update is applied. In flight, the engine reloads the weights it had
and samples on; the tokens sampled while the probe ran are labelled `UNVERIFIED_VERSION` (the
engine loop records which weights sampled each token) and their samples are sampled again.
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
from grpo.weights.adapter import EngineAdapters
from grpo.weights.base import ReceivingEnd
from grpo.weights.checksum import WeightSyncError
from grpo.weights.engine import WeightReceiver, WeightUpdate
from grpo.weights.transports import receiving_end

log = logging.getLogger(__name__)

# Consecutive rejected in-flight updates after which the collector stops: weights that never
# verify are a fault to report, not a reason to keep sampling with ever older ones.
MAX_REJECTED_UPDATES_IN_A_ROW = 3
# The label of tokens sampled with weights that then failed verification (the running samples
# go on while the probe runs). A sample holding any is sampled again from its start, never
# trained on.
UNVERIFIED_VERSION = -1


def in_flight(updates: WeightUpdateMode) -> bool:
    """Weights are loaded between engine steps, not only between batches."""
    return updates != "between_batches"


class EngineWeights:
    """The weights of one collector's vLLM engine: received, loaded, verified, rolled back.

    `receive` may be called from any thread (the actor's ``weights`` thread, beside
    generation); every other method runs under the engine lock, on the thread that steps the
    engine.

    Args:
        llm: The collector's ``vllm.LLM``, started with
            ``worker_extension_cls=grpo.weights.engine.WORKER_EXTENSION_CLS``.
        engine_lock (threading.RLock): The collector's lock around its engine, which is not
            thread-safe.
        add_request (Callable): ``add_request(request_id, token_ids, params)``: add a request
            to the engine whose one output comes when it finishes (the probe is one).
        engine_step (Callable): One step of the engine's scheduler; returns the requests that
            finished (the probe finds its own among them; the others are the engine's).
        owner (str): The collector's name (``collector[0]``), in errors and log lines.
        model_dir (str): The model folder the engine was started from: the weights a rollback
            reloads before any update was kept.
        policy_version (int): The policy version of those weights.
        verify (bool): Check the checksum of every update the engine loads.
        adapters (EngineAdapters | None): With ``training.lora``: updates are LoRA adapters,
            each version served as an adapter of its own (`grpo.weights.adapter`); None:
            updates are full weights, loaded in place.
        tokens: The engine's record of which weights sampled each token, told of every
            in-flight switch (`grpo.workers.vllm_engine.TokenVersions`: ``mark(version)``,
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
        self.pending = WeightReceiver()
        # The version of the verified weights the engine holds (what samples are labelled
        # with), and of the weights it samples with right now (the new ones while they are
        # being verified in flight).
        self.policy_version = int(policy_version)
        self.sampling_version = self.policy_version
        self._error: str | None = None  # set while the engine holds unverified weights
        # The probe of the weights the engine holds (the last verified update's), run again
        # after the engine woke from sleep (`apply_pending`'s ``before_probe``), and the
        # version of the last probe that passed.
        self.current_probe: dict[str, Any] | None = None
        self.probed_version: int | None = None
        # The weights a rejected in-flight update rolls back to (None: the model folder's,
        # while `_can_roll_back`).
        self._loaded_weights: Mapping[str, torch.Tensor] | None = None
        self._can_roll_back = True
        self._rejected_in_a_row = 0
        # Prefix-cache blocks the old weights computed, still held by running sequences when
        # new weights came (in_flight_keep_kv): dropped as soon as the engine is idle.
        self._stale_prefix_cache = False
        # The current batch's in-flight updates and the time generation paused for them (the
        # collector resets it per batch), and cumulative counts.
        self.batch_switches = {"updates": 0.0, "pause_s": 0.0}
        self.totals = {"weight_updates_in_flight": 0.0, "weight_updates_rejected": 0.0}

    # ------------------------------------------------------------------ receiving

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
            weights: What the trainer's sending end published (`ReceivingEnd.receive`): with
                ``object_store``, ``dict[str, Tensor]`` under HF names or a Ray ``ObjectRef``
                to one; with ``collective``, the tensors' specs.
            version (int): Their policy version; must exceed the current one.
            checksum (str | None): `state_dict_checksum` of the weights, checked on load.
            probe (dict | None): Optional logprob check, see `WeightUpdate`.
            transport (str): The transport that sent them (``weight_sync.transport``); the
                first receive builds its end, the only one this collector holds.
            connection: A new connection to the sending end (`SendingEnd.connect`), or None.

        Returns:
            bool: False (and ignored) if the version is not newer than both the engine's and
            the pending update's.

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

    # ------------------------------------------------------------------ applying

    def apply_pending(
        self,
        updates: WeightUpdateMode,
        *,
        before_probe: Callable[[WeightUpdate | None], None] | None = None,
    ) -> float:
        """Load pending weights, if any, into the engine and bump ``policy_version``.

        Args:
            updates (WeightUpdateMode): ``inference.weight_updates``: in flight, an update
                that fails verification is rolled back (`_switch`).
            before_probe (Callable | None): Given, the engine is idle and loads between
                batches whatever ``updates`` says: the hook is called with the update loaded
                (None: nothing was pending) before its probe runs, and with nothing pending
                the weights the engine holds are probed again (`current_probe`). An engine
                waking from sleep wakes its KV cache there, which the probe needs
                (`grpo.workers.engine_sleep`), and proves it did not wake with stale weights.

        Returns:
            float: Seconds spent (0.0 if nothing was pending).

        Raises:
            WeightSyncError: Between batches, if the checksum or the probe does not match, or
                an earlier update failed and no good one has arrived since. The engine then
                holds weights it cannot vouch for: generation and evaluation refuse to run
                (rather than label samples with a wrong ``policy_version``) until a verified
                update is applied. In flight, see `_switch`.
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
        """With updates in flight, load pending weights before the engine's next step (hold
        the engine lock): full weights switch under the running requests (`_switch`), a LoRA
        adapter serves new requests only (`_switch_adapter`).

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
        """Load pending weights now, between two steps of the engine (hold the engine lock).

        The engine's running requests are preempted and prefilled again with the new weights,
        so each samples on as the new policy; the versions of the tokens each has so far are
        recorded first. An update whose checksum or probe fails is rolled back: the engine
        reloads the weights it had, keeps its version and samples on; the tokens sampled while
        the probe ran are labelled `UNVERIFIED_VERSION`, and the samples holding them are
        sampled again (by the collector's generation).

        With ``keep_kv`` the running requests keep their KV cache instead; its blocks are then
        dropped from the prefix cache once the engine is idle (`load_between_steps`), so no
        later prompt reuses keys and values of the old weights.

        Returns:
            float: Seconds generation was paused (0.0 if nothing was pending).

        Raises:
            WeightSyncError: After `MAX_REJECTED_UPDATES_IN_A_ROW` rejected updates in a row,
                or a rejected update whose previous weights were not kept (on the GPU).
        """
        self._drop_stale_prefix_cache()
        if not self.pending.has_pending:
            return 0.0
        start = time.perf_counter()
        running = self.llm.llm_engine.has_unfinished_requests()
        self._mark_tokens(self.sampling_version)  # the tokens so far: the weights replaced
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
        # Kept for a rollback where that costs no accelerator memory (on CPU a reload copies
        # them into vLLM's own packed weights anyway); a GPU copy would double the weights.
        on_cpu = all(t.device.type == "cpu" for t in applied.weights.values())
        self._loaded_weights = applied.weights if on_cpu else None
        self._can_roll_back = on_cpu
        self.policy_version = applied.version
        return self._accepted(applied, start, running)

    def _switch_adapter(
        self, before_probe: Callable[[WeightUpdate | None], None] | None = None
    ) -> float:
        """Load a pending LoRA adapter and serve it to new requests (hold the engine lock).

        Running requests keep the adapter they started with, so nothing is preempted and no
        token changes version under a sequence. A version whose checksum or probe fails is
        discarded: the engine serves the previous one on, as it did during the check.
        ``before_probe``: as `apply_pending`'s (an engine woken from sleep).

        Returns:
            float: Seconds the load and the check took (0.0 if nothing was pending).

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
        """Roll back an in-flight update that failed verification, and label what it sampled.

        Raises:
            WeightSyncError: If the weights cannot be rolled back, or this was the
                `MAX_REJECTED_UPDATES_IN_A_ROW`-th rejection in a row.
        """
        # The tokens sampled while the probe ran, by samples still running and by those that
        # finished meanwhile (not yet handed out), came from the rejected weights.
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

    # ------------------------------------------------------------------ verification

    def _check_probe(self, probe: dict[str, Any], version: int) -> None:
        checks.check_probe(self.probe_logprobs(probe["token_ids"]), probe, version)
        self.probed_version = version

    def _probe_current(self) -> None:
        """Probe the weights the engine holds again (`current_probe`, if known)."""
        if self.current_probe is not None:
            self._check_probe(self.current_probe, self.policy_version)

    def checksum(self) -> str | None:
        """`state_dict_checksum` of the weights the engine was last loaded with (with LoRA:
        of the adapter it serves to new requests)."""
        with self._lock:
            if self.adapters is not None:
                return self.adapters.current_checksum
            return self.llm.collective_rpc("grpo_weights_checksum")[0]

    def probe_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """The engine's logprob of every token of ``token_ids`` after the first
        (`grpo.weights.verify.probe_logprobs`).

        The trainer computes the same numbers with its model to check that the engine really
        computes with the synced weights (a checksum only proves they arrived).

        Raises:
            ValueError: With fewer than two token ids.
        """
        with self._lock:
            return checks.probe_logprobs(self._add_request, self._engine_step, token_ids)

    # ------------------------------------------------------------------ metrics

    def start_batch(self) -> None:
        """Count the next batch's in-flight updates from zero."""
        self.batch_switches = {"updates": 0.0, "pause_s": 0.0}

    def batch_metrics(self, runs: Sequence[Sequence[tuple[int, int]]]) -> dict[str, float]:
        """Weight updates during the batch and how old the policy of its tokens is.

        Args:
            runs (Sequence): The ``(version, tokens)`` runs of each sample of the batch.

        Returns:
            dict[str, float]: ``inference/weight_updates_*``, the engine's pause, the samples
            that span versions, and ``inference/tokens_version_lag_K``: the sampled tokens
            whose weights were K versions (2: two or more) older than the engine's at the end
            of the batch (a version counts training steps: with
            ``weight_sync.every_n_steps: N``, two syncs are N versions apart).
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
