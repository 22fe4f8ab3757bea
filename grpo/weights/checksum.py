"""One definition of "these weights": the trainer hashes the state dict it sends, the vLLM
worker the tensors it actually loads, and the two must agree exactly."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch

# The checksum of "no LoRA adapter": the base model, which a fresh adapter (B = 0) computes
# exactly. A LoRA run's trainer reports it until its adapter has changed, and a collector
# until it has loaded one.
NO_ADAPTER_CHECKSUM = "no-adapter"


def adapter_checksum(named_tensors: Mapping[str, torch.Tensor]) -> str:
    """What a LoRA adapter computes, as both ends report it: `NO_ADAPTER_CHECKSUM` while every
    B (``lora_B``) is zero (the base model), else `state_dict_checksum` of its tensors."""
    return (
        NO_ADAPTER_CHECKSUM
        if is_base_adapter(named_tensors)
        else state_dict_checksum(named_tensors)
    )


def is_base_adapter(named_tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether a PEFT adapter computes the base model: it has B matrices and all are zero."""
    lora_b = [t for name, t in named_tensors.items() if name.endswith("lora_B.weight")]
    return bool(lora_b) and not any(bool(t.any()) for t in lora_b)


class WeightSyncError(RuntimeError):
    """Weights did not arrive intact (checksum mismatch) or the engine does not use them."""


def state_dict_checksum(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> str:
    """SHA-256 of a set of named tensors, independent of their order, device and float width.

    Tensors are visited in sorted-name order; each contributes its name, its shape and the
    bytes of its values cast to float32 (integer and bool tensors too). Casting bf16 or fp16
    to float32 is exact, so a bf16 state dict and its float32 upcast hash the same, and the
    trainer (whatever its dtype) and the vLLM worker agree exactly, with no tolerance.

    Args:
        named_tensors (Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]): HF
            names to tensors, e.g. ``tune_to_hf_state_dict(model.state_dict(), hf_config)``.

    Returns:
        str: 64 hex digits.

    Raises:
        ValueError: If a name appears twice.

    Example:
        >>> state_dict_checksum({"w": torch.ones(2)}) == state_dict_checksum(
        ...     {"w": torch.ones(2, dtype=torch.bfloat16)})
        True
    """
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    names = [name for name, _ in items]
    if len(set(names)) != len(names):
        duplicates = sorted({name for name in names if names.count(name) > 1})
        raise ValueError(f"state_dict_checksum: duplicate tensor names {duplicates[:5]}")
    digest = hashlib.sha256()
    for name, tensor in sorted(items, key=lambda item: item[0]):
        values = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()
        digest.update(f"{name}\0{tuple(values.shape)}\0".encode())
        digest.update(memoryview(values.numpy()).cast("B"))
    return digest.hexdigest()
