"""The collector's side of weight sync: loading new weights into vLLM and proving they arrived.

Two pieces:

* `WeightSyncWorkerExtension`: methods added to vLLM's worker (engine argument
  ``worker_extension_cls``) and called through ``LLM.collective_rpc``; they reload weights in
  place and report the checksum.
* `WeightReceiver` (collector side): keeps the newest update pending and loads it into the
  engine, whichever transport brought it; `grpo.weights.receiver.EngineWeights` decides when
  (between two engine steps or generation batches) and verifies it.

Why the checksum is over the sent HF state dict and not over vLLM's parameters: vLLM fuses
``q/k/v_proj`` into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj``, pads the vocabulary,
and on CPU it repacks every linear weight into a oneDNN handle and leaves an empty
``weight`` parameter behind. vLLM's parameters can therefore not be hashed back into HF names.
The checksum proves the worker received exactly the trainer's tensors and handed them to the
loader. That the engine then computes with them is a separate, functional check: compare
`grpo.weights.verify.probe_logprobs` with the trainer's own forward (the trainer's probe,
checked with every update).

This module imports neither vLLM nor Ray at import time. The checksum both ends compute is
`grpo.weights.checksum.state_dict_checksum`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from grpo.weights.checksum import state_dict_checksum
from grpo.weights.verify import check_checksums

WORKER_EXTENSION_CLS = "grpo.weights.engine.WeightSyncWorkerExtension"


class WeightSyncWorkerExtension:
    """Methods mixed into vLLM's worker class; call them with ``LLM.collective_rpc``.

    Enable with ``LLM(..., worker_extension_cls=WORKER_EXTENSION_CLS)``. Method names carry a
    ``grpo_`` prefix because vLLM refuses extensions that shadow worker attributes (the GPU
    worker has its own ``update_weights``).

    Example:
        >>> [checksum] = llm.collective_rpc("grpo_update_weights", args=(hf_state_dict,))
    """

    def grpo_update_weights(
        self, weights: Mapping[str, torch.Tensor], compute_checksum: bool = True
    ) -> str | None:
        """Load HF-named weights into the running model in place.

        Args:
            weights (Mapping[str, torch.Tensor]): Full state dict under HF names (as stored in
                the model folder's safetensors), on any device.
            compute_checksum (bool): Hash the received tensors with `state_dict_checksum`.

        Returns:
            str | None: The checksum of the loaded tensors, or None if not computed.
        """
        checksum = state_dict_checksum(weights) if compute_checksum else None
        runner = self.model_runner
        if hasattr(runner, "reload_weights"):
            # Handles fused projections (qkv, gate_up), tensor-parallel sharding and the
            # post-load processing (CPU weight repacking) layer by layer.
            runner.reload_weights(weights_iterator=iter(weights.items()))
        else:  # older vLLM: plain load; fine on GPU, where weights are not repacked
            runner.get_model().load_weights(weights=iter(weights.items()))
        _refresh_vocab_projections(runner.get_model())
        self._grpo_weights_checksum = checksum
        self._grpo_weights_checksum_known = True
        return checksum

    def grpo_weights_checksum(self) -> str | None:
        """Checksum of the weights the model holds.

        Before any update these are the model folder's safetensors, hashed from the files;
        after an update, the checksum computed when it was loaded (None if it was loaded with
        ``compute_checksum=False``).
        """
        if not getattr(self, "_grpo_weights_checksum_known", False):
            from grpo.models import load_hf_state_dict

            weights = load_hf_state_dict(self.model_config.model)
            self._grpo_weights_checksum = state_dict_checksum(weights)
            self._grpo_weights_checksum_known = True
        return self._grpo_weights_checksum


def _refresh_vocab_projections(model: torch.nn.Module) -> None:
    """Rebuild the output projection's matmul kernel after an in-place reload.

    On CPU vLLM turns each linear weight into a packed oneDNN copy when it is loaded. With
    tied embeddings ``lm_head`` shares ``embed_tokens.weight`` but is never loaded by name, so
    an in-place reload updates the shared tensor and leaves ``lm_head`` computing logits with
    a packed copy of the OLD weights: sampling and logprobs then silently use stale output
    projections. Re-running the (idempotent, weight-keeping) post-load step of the unquantized
    output projection rebuilds the packed copy; on GPU it is a no-op.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
    )

    for module in model.modules():
        if isinstance(module, ParallelLMHead) and isinstance(
            getattr(module, "quant_method", None), UnquantizedEmbeddingMethod
        ):
            module.quant_method.process_weights_after_loading(module)


@dataclass
class WeightUpdate:
    """One published version of the policy weights.

    Args:
        version (int): Policy version the weights belong to.
        weights (Any): ``dict[str, Tensor]`` under HF names, or a Ray ``ObjectRef`` to one.
        checksum (str | None): `state_dict_checksum` of the weights, checked after loading.
        probe (dict | None): Optional functional check, ``{"token_ids": list[int],
            "logprobs": list[float], "atol": float}``: after loading, the engine's logprobs of
            ``token_ids[1:]`` must match ``logprobs`` (the trainer's own forward).
    """

    version: int
    weights: Any
    checksum: str | None = None
    probe: dict[str, Any] | None = None


class WeightReceiver:
    """Collector side: hold the newest pending update and apply it to a vLLM engine.

    `offer` may be called from any thread (a Ray actor with ``max_concurrency > 1`` receives
    weights while it generates); `apply_pending` runs on the thread that owns the engine,
    between two of its steps or between generation batches. An offered version not newer
    than both the engine's and the pending one is ignored (a late, older update), and a
    pending update replaced by a newer one before it was applied is counted in
    ``num_superseded`` (the newer weights are complete, so nothing is lost).

    Every transport offers its updates here the same way.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: WeightUpdate | None = None
        self.num_superseded = 0
        self.num_ignored = 0

    def offer(self, update: WeightUpdate, current_version: int) -> bool:
        """Keep ``update`` as the pending one if it is newer than the engine's and the pending one.

        Args:
            update (WeightUpdate): The update.
            current_version (int): The version the engine holds now.

        Returns:
            bool: Whether it was kept.
        """
        with self._lock:
            pending_version = self._pending.version if self._pending is not None else -1
            if update.version <= max(current_version, pending_version):
                self.num_ignored += 1
                return False
            if self._pending is not None:
                self.num_superseded += 1
            self._pending = update
            return True

    @property
    def has_pending(self) -> bool:
        """Whether an update waits to be applied."""
        with self._lock:
            return self._pending is not None

    def take(self) -> WeightUpdate | None:
        """The pending update, its weights resolved (no longer pending); None if none."""
        with self._lock:
            update, self._pending = self._pending, None
        if update is not None and not isinstance(update.weights, Mapping):
            import ray  # an ObjectRef that was not resolved on arrival

            update.weights = ray.get(update.weights)
        return update

    def apply_pending(
        self, llm: Any, verify: bool = True, recompute_running: bool = False
    ) -> WeightUpdate | None:
        """Load the pending update, if any, into ``llm`` and check its checksum.

        Args:
            llm: A ``vllm.LLM`` started with ``worker_extension_cls=WORKER_EXTENSION_CLS``.
            verify (bool): Compute the checksum on the worker and compare it with the sent one.
            recompute_running (bool): Preempt the engine's running requests (an update in
                flight): their KV cache was computed with the old weights, so each is prefilled
                again, prompt and tokens so far, with the new ones before it samples on.

        Returns:
            WeightUpdate | None: The update now in the engine (its ``probe`` is the caller's to
            check), or None if nothing was pending.

        Raises:
            WeightSyncError: If a worker's checksum differs from the sent one. The engine then
                holds the received (unverified) tensors; the caller must not label its
                samples with the new version.
        """
        update = self.take()
        if update is None:
            return None
        weights = update.weights
        compute = verify and update.checksum is not None
        checksums = llm.collective_rpc("grpo_update_weights", args=(weights, compute))
        # Cached KV blocks were computed with the old weights; a prompt sharing a prefix with
        # an earlier one would otherwise reuse them.
        llm.reset_prefix_cache(reset_running_requests=recompute_running)
        if compute:
            check_checksums(checksums, update.checksum, update.version)
        return update
