"""A collector's LoRA adapters: each policy version is a vLLM LoRA adapter of its own, or, served
merged (`MergedAdapters`), folded into the base weights that vLLM runs without LoRA.

A request keeps the adapter it was added with to its end, so an update never changes the
weights under a running sequence and a rejected update costs nothing to roll back. Version 0
is the base model (a fresh adapter computes it exactly). The checksum is over the tensors read
back from the folder vLLM loads, so it proves what the engine reads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from grpo.choices import VLLM_LORA_RANKS
from grpo.config.sections import lora_served_merged
from grpo.process_pool import remove_orphaned_folders
from grpo.weights.checksum import (
    NO_ADAPTER_CHECKSUM,
    WeightSyncError,
    is_base_adapter,
    state_dict_checksum,
)
from grpo.weights.engine import WeightReceiver, WeightUpdate

log = logging.getLogger(__name__)


# Adapter folders live in the temporary directory under this prefix and the collector's pid; a
# collector that is killed (a stall, a lost node, a test) cannot delete its own.
ADAPTER_DIR_PREFIX = "grpo-adapters-"


def engine_lora_args(rank: int) -> dict[str, Any]:
    """``vllm.LLM`` arguments that serve adapters of ``rank``.

    Two adapters are active at once: the newest for new requests, the previous one for those
    still running. The engine takes the smallest rank vLLM accepts at or above ``rank``.

    Raises:
        ValueError: If ``rank`` is above the largest rank vLLM serves.
    """
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(
            f"training.lora.rank={rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}"
        )
    return {"enable_lora": True, "max_lora_rank": fitting[0], "max_loras": 2, "max_cpu_loras": 3}


def engine_adapters(
    llm: Any, lora: Any, model_dir: str, adapter_dir: str | None, policy_version: int
) -> EngineAdapters | None:
    """The adapters of an engine started with `engine_lora_args` (None without ``lora``).

    Args:
        adapter_dir: The PEFT folder of ``policy_version``, the version the engine starts
            with; None: the base model.
    """
    if lora is None:
        return None
    from grpo.models.lora import peft_adapter_config

    config = peft_adapter_config(lora, model_dir)
    return EngineAdapters(llm, config, adapter_dir, policy_version)


def serves_merged(lora: Any, on_cpu: bool | None = None) -> bool:
    """Whether a collector serves ``training.lora`` merged into the base weights.

    ``serve: auto`` is merged on CPU and adapter on GPU: vLLM's CPU LoRA layers gather a copy
    of each scheduled token's adapter matrices at every engine step (half the demo engine's
    time, profiled), while serving merged weights costs one merge and one in-place load per
    update (docs/training.md#lora).

    Args:
        lora: ``training.lora``.
        on_cpu: Whether the engine runs on CPU; None: whether CUDA is unavailable here.
    """
    on_cpu = (not torch.cuda.is_available()) if on_cpu is None else on_cpu
    return lora_served_merged(lora.serve, on_cpu)


class MergedAdapters:
    """A collector's adapters served merged: vLLM runs without LoRA on base + adapter weights.

    Each update's adapter, once its checksum matches the sender's, is folded into this
    collector's copy of the base weights (`merge_peft_adapter`) and the update goes on as a
    full one: loaded in place, its checksum over the merged tensors checked on the worker,
    its probe run, rolled back if rejected. `checksum` reports the adapter's (what the trainer
    reports), the engine's own is the merged weights'.

    Args:
        model_dir: The base model folder.
        lora: ``training.lora``.
        verify: Check each adapter's checksum against the sender's.
    """

    def __init__(self, model_dir: str, lora: Any, verify: bool = True) -> None:
        from grpo.models import load_hf_state_dict

        self.base = load_hf_state_dict(model_dir)
        self.scale = float(lora.alpha) / int(lora.rank)
        self.verify = verify
        self.initial_weights: dict[str, torch.Tensor] | None = None  # merged, if not the base
        self._checksums: dict[int, str] = {}  # version -> its adapter's checksum

    def start(self, llm: Any, adapter_dir: str | None, version: int) -> None:
        """Load the adapter of a PEFT folder (None: nothing, the engine holds the base) merged
        into the engine as ``version``.

        Raises:
            WeightSyncError: If the engine's checksum of what it loaded is not the merged one.
        """
        if adapter_dir is None:
            return
        from grpo.weights.verify import check_checksums

        tensors = _read_safetensors(Path(adapter_dir) / "adapter_model.safetensors")
        merged = self._merge(tensors, int(version))
        checksums = llm.collective_rpc("grpo_update_weights", args=(merged, True))
        llm.reset_prefix_cache()
        check_checksums(checksums, state_dict_checksum(merged), int(version))
        self.initial_weights = merged

    def _merge(self, tensors: Mapping[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
        from grpo.models.lora import merge_peft_adapter

        self._checksums[version] = (
            NO_ADAPTER_CHECKSUM if is_base_adapter(tensors) else state_dict_checksum(tensors)
        )
        for old in sorted(self._checksums)[:-4]:  # the served, pending and probed ones stay
            del self._checksums[old]
        return merge_peft_adapter(self.base, tensors, self.scale)

    def merged_update(self, update: WeightUpdate) -> WeightUpdate:
        """The full update that serves ``update``'s adapter merged.

        Raises:
            WeightSyncError: If the adapter's checksum differs from the sender's.
        """
        check = self.verify and update.checksum is not None
        if check:
            received = state_dict_checksum(update.weights)
            if received != update.checksum:
                raise WeightSyncError(
                    f"adapter of version {update.version}: received tensors with checksum "
                    f"{received}, the sender's checksum is {update.checksum}"
                )
        merged = self._merge(update.weights, int(update.version))
        return WeightUpdate(
            version=update.version,
            weights=merged,
            checksum=state_dict_checksum(merged) if check else None,
            probe=update.probe,
        )

    def checksum(self, version: int) -> str:
        """The checksum of ``version``'s adapter, as the trainer computes it
        (`NO_ADAPTER_CHECKSUM` for a fresh one)."""
        return self._checksums.get(int(version), NO_ADAPTER_CHECKSUM)

    def receiver(self) -> MergingReceiver:
        """A `WeightReceiver` whose updates come out merged."""
        return MergingReceiver(self)


class MergingReceiver(WeightReceiver):
    """`WeightReceiver` of adapter updates that hands them on merged (`MergedAdapters`)."""

    def __init__(self, adapters: MergedAdapters) -> None:
        super().__init__()
        self.adapters = adapters

    def take(self) -> WeightUpdate | None:
        """The pending update merged, or None.

        Raises:
            WeightSyncError: If its adapter's checksum differs from the sender's.
        """
        update = super().take()
        return None if update is None else self.adapters.merged_update(update)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


class EngineAdapters:
    """The LoRA adapters a collector's engine serves, one per policy version.

    Hold the engine lock around every call.

    Args:
        llm: The ``vllm.LLM``, started with `engine_lora_args`.
        initial_dir: A PEFT folder to start from, served as ``policy_version``; None: the base
            model.
    """

    def __init__(
        self,
        llm: Any,
        adapter_config: Mapping[str, Any],
        initial_dir: str | None = None,
        policy_version: int = 0,
    ) -> None:
        self.llm = llm
        self.adapter_config = dict(adapter_config)
        remove_orphaned_folders(ADAPTER_DIR_PREFIX)
        self.root = Path(tempfile.mkdtemp(prefix=f"{ADAPTER_DIR_PREFIX}{os.getpid()}-"))
        self.current_checksum = NO_ADAPTER_CHECKSUM
        self._requests: dict[int, Any] = {}  # version -> its LoRARequest
        self._checksums: dict[int, str] = {}  # version -> checksum of its folder's tensors
        self._probing: int | None = None  # a loaded version not yet verified, for the probe
        self._running = Counter()  # version -> requests running with it
        self._version_of_request: dict[str, int] = {}
        self._current_version = int(policy_version)
        if initial_dir is not None:
            tensors = _read_safetensors(Path(initial_dir) / "adapter_model.safetensors")
            self.load(tensors, int(policy_version), checksum=None)
            self.activate(int(policy_version))

    def request_added(self, request_id: str) -> Any:
        """The ``LoRARequest`` of a new request (None: the base model); counts it as running."""
        version = self._current_version if self._probing is None else self._probing
        self._version_of_request[request_id] = version
        self._running[version] += 1
        return self._requests.get(version)

    @contextlib.contextmanager
    def probing(self, version: int) -> Iterator[None]:
        """Requests added inside get ``version``'s adapter (loaded, not yet activated)."""
        self._probing = int(version)
        try:
            yield
        finally:
            self._probing = None

    def version_of(self, request_id: str) -> int | None:
        """The version of the adapter a request was added with (None: not known here)."""
        return self._version_of_request.get(request_id)

    def request_finished(self, request_id: str) -> None:
        """A request ended: an older adapter that no request uses any more is removed."""
        version = self._version_of_request.pop(request_id, None)
        if version is None:
            return
        self._running[version] -= 1
        if self._running[version] <= 0:
            del self._running[version]
            # A newer version is being verified by its probe and is activated next.
            if version < self._current_version:
                self._remove(version)

    def forget_requests(self) -> None:
        """Every request was aborted: drop what is counted and every older adapter."""
        self._version_of_request.clear()
        self._running.clear()
        for version in [v for v in self._requests if v < self._current_version]:
            self._remove(version)

    def load(self, tensors: Mapping[str, torch.Tensor], version: int, checksum: str | None) -> str:
        """Write ``tensors`` as the PEFT folder of ``version`` and load it into the engine.

        New requests keep the current adapter until `activate`.

        Args:
            tensors: The adapter under PEFT names.
            version: Its policy version (> 0).
            checksum: The sender's `state_dict_checksum`; None: not checked.

        Returns:
            str: The checksum of the tensors read back from the folder the engine loads.

        Raises:
            WeightSyncError: If that checksum differs from the sender's, or vLLM cannot load
                the folder.
        """
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        folder = self.root / f"v{version}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        save_file(
            {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()},
            str(folder / "adapter_model.safetensors"),
        )
        (folder / "adapter_config.json").write_text(json.dumps(self.adapter_config, indent=2))
        loaded = state_dict_checksum(_read_safetensors(folder / "adapter_model.safetensors"))
        if checksum is not None and loaded != checksum:
            shutil.rmtree(folder, ignore_errors=True)
            raise WeightSyncError(
                f"adapter of version {version}: the folder the engine loads holds tensors with "
                f"checksum {loaded}, the sender's checksum is {checksum}"
            )
        request = LoRARequest(f"policy-v{version}", int(version), str(folder))
        try:
            self.llm.llm_engine.add_lora(request)
        except Exception as error:  # noqa: BLE001 - vLLM's loader raises many kinds
            shutil.rmtree(folder, ignore_errors=True)
            raise WeightSyncError(
                f"adapter of version {version}: vLLM could not load it: {error}"
            ) from error
        self._requests[int(version)] = request
        # What `adapter_checksum` reports, without hashing the tensors a second time.
        self._checksums[int(version)] = NO_ADAPTER_CHECKSUM if is_base_adapter(tensors) else loaded
        return loaded

    def activate(self, version: int) -> None:
        """Serve ``version`` (loaded) to new requests; an unused older one is removed."""
        previous = self._current_version
        self._current_version = int(version)
        self.current_checksum = self._checksums[int(version)]
        if previous != version and not self._running.get(previous):
            self._remove(previous)

    def discard(self, version: int) -> None:
        """Remove a loaded version that failed verification (never activated for requests)."""
        if version != self._current_version:
            self._remove(version)

    def _remove(self, version: int) -> None:
        request = self._requests.pop(version, None)
        if request is None:
            return
        try:
            self.llm.llm_engine.remove_lora(request.lora_int_id)
        except Exception as error:  # noqa: BLE001 - an adapter vLLM already evicted
            log.debug("removing adapter %s: %s", request.lora_name, error)
        shutil.rmtree(Path(request.lora_path), ignore_errors=True)

    def close(self) -> None:
        """Delete every adapter folder."""
        shutil.rmtree(self.root, ignore_errors=True)
