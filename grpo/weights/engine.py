"""The collector's side of weight sync: loading new weights into vLLM in place.

The checksum is over the HF state dict the worker received, not over vLLM's parameters (fused,
padded, repacked); the probe logprobs check that the engine computes with them.
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

    Enable with ``LLM(..., worker_extension_cls=WORKER_EXTENSION_CLS)``. The ``grpo_`` prefix:
    vLLM refuses extensions that shadow worker attributes (the GPU worker has ``update_weights``).
    """

    def grpo_update_weights(
        self, weights: Mapping[str, torch.Tensor], compute_checksum: bool = True
    ) -> str | None:
        """Load a full HF-named state dict in place; its checksum, or None if not computed."""
        checksum = state_dict_checksum(weights) if compute_checksum else None
        runner = self.model_runner
        if not reload_cpu_linear_weights(runner, weights):
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
        """Checksum of the weights the model holds: the model folder's before any update, else
        the one computed at load (None if it was not)."""
        if not getattr(self, "_grpo_weights_checksum_known", False):
            from grpo.models import load_hf_state_dict

            weights = load_hf_state_dict(self.model_config.model)
            self._grpo_weights_checksum = state_dict_checksum(weights)
            self._grpo_weights_checksum_known = True
        return self._grpo_weights_checksum


# Most bytes of unpacked linear weights `reload_cpu_linear_weights` allocates at once.
FAST_RELOAD_MAX_BYTES = 1 << 30


def reload_cpu_linear_weights(runner: Any, weights: Mapping[str, torch.Tensor]) -> bool:
    """Load a full HF state dict into an unquantized CPU engine, in place; False if it is not one.

    On CPU vLLM packs each linear weight into a oneDNN (or sgl) kernel at load and drops the
    weight. Its generic ``reload_weights`` rebuilds every layer from meta tensors, wraps and
    counts every loader call, then repacks: 9.6 ms a reload of the 1M-parameter demo model in
    bf16, against 1.1 ms here. This gives each packed layer a full-size weight again (from the
    shapes vLLM recorded at load), loads the state dict with the model's own loaders (which
    fuse q/k/v and gate/up), and repacks those layers through vLLM's post-load step, which
    drops the weights again. The weights start as NaN: a layer the state dict does not fill
    completely sends the whole update down vLLM's generic path instead. So does a model whose
    packed weights exceed `FAST_RELOAD_MAX_BYTES`: this holds all of them unpacked at once,
    vLLM's path one layer at a time.

    Args:
        runner: The vLLM worker's model runner.
        weights: HF names to tensors, every weight of the model.

    Returns:
        bool: Whether the weights were loaded here.
    """
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    model = runner.get_model()
    if (
        runner.device.type != "cpu"
        or getattr(runner, "lora_config", None) is not None
        or runner.model_config.quantization is not None
    ):
        return False
    # (layer, its emptied weight, the full-size weight vLLM recorded at load, on meta)
    packed: list[tuple[torch.nn.Module, torch.nn.Parameter, torch.Tensor]] = []
    for layer in model.modules():
        if not isinstance(layer, LinearBase):
            continue
        if not isinstance(layer.quant_method, UnquantizedLinearMethod):
            return False
        if not hasattr(layer, "cpu_linear") or layer.weight.numel():
            continue  # not repacked (a kept weight is loaded in place)
        info = LAYERWISE_INFO.get(layer)
        recorded = info.restore_metadata[0].get("weight") if info is not None else None
        if recorded is None:
            return False
        packed.append((layer, layer.weight, recorded))
    if sum(r.numel() * r.element_size() for _, _, r in packed) > FAST_RELOAD_MAX_BYTES:
        return False
    for layer, _, recorded in packed:
        # The recorded parameter class and attributes (its weight_loader) are what the
        # model's loaders use.
        weight = restore_layer_refs(materialize_meta_tensor(recorded), layer)
        weight.data.fill_(float("nan"))
        layer.weight = weight
    with torch.no_grad():
        model.load_weights(weights=iter(weights.items()))
        # A NaN left anywhere makes the sum NaN: one vectorised pass, where isnan().any() on
        # one thread took 13x as long for the demo model's bf16 layers (1.2 against 0.09 ms;
        # 1.45 of the 6.7 CPU ms a reload took inside a collector). +inf beside -inf makes
        # NaN too; such an update takes vLLM's path, which is still correct.
        unfilled = any(bool(layer.weight.sum().isnan()) for layer, _, _ in packed)
    if unfilled:
        for layer, emptied, _ in packed:  # as they were: vLLM's path loads the update again
            layer.weight = emptied
        return False
    for layer, _, _ in packed:
        layer.quant_method.process_weights_after_loading(layer)
    return True


def _refresh_vocab_projections(model: torch.nn.Module) -> None:
    """Rebuild the output projection's packed kernel after an in-place reload.

    On CPU vLLM packs each linear weight into a oneDNN copy at load. A tied ``lm_head`` is never
    loaded by name, so without this it silently keeps a packed copy of the OLD weights. The
    post-load step is idempotent; on GPU a no-op.
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
        weights: ``dict[str, Tensor]`` under HF names, or a Ray ``ObjectRef`` to one.
        probe: Optional ``{"token_ids", "logprobs"}`` and a `ProbeTolerance`'s fields: after
            loading, the engine's logprobs of ``token_ids[1:]`` must match the trainer's
            ``logprobs`` (`check_probe`).
    """

    version: int
    weights: Any
    checksum: str | None = None
    probe: dict[str, Any] | None = None


class WeightReceiver:
    """Hold the newest pending update and apply it to a vLLM engine.

    `offer` may be called from any thread; `apply_pending` on the thread that owns the engine.
    Older offers are ignored (``num_ignored``); a pending update replaced before it was applied
    is counted in ``num_superseded``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: WeightUpdate | None = None
        self.num_superseded = 0
        self.num_ignored = 0

    def offer(self, update: WeightUpdate, current_version: int) -> bool:
        """Keep ``update`` if newer than the engine's ``current_version`` and the pending one.

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
            recompute_running: Preempt running requests so they are prefilled again with the
                new weights (an update in flight).

        Returns:
            WeightUpdate | None: The update now in the engine (its ``probe`` is the caller's to
            check), or None if nothing was pending.

        Raises:
            WeightSyncError: If a worker's checksum differs from the sent one; the engine then
                holds the unverified tensors.
        """
        update = self.take()
        if update is None:
            return None
        weights = update.weights
        compute = verify and update.checksum is not None
        checksums = llm.collective_rpc("grpo_update_weights", args=(weights, compute))
        # Otherwise a prompt sharing a prefix would reuse KV blocks of the old weights.
        llm.reset_prefix_cache(reset_running_requests=recompute_running)
        if compute:
            check_checksums(checksums, update.checksum, update.version)
        return update
