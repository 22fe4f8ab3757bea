"""Checks of ``training.lora`` against vLLM's LoRA support and the model it adapts.

These read files only (the safetensors header, not the weights) and import neither torch nor
vLLM, so ``grpo validate`` stays fast.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from grpo.choices import LORA_HF_MODULES as _HF_MODULES
from grpo.choices import VLLM_LORA_RANKS as VLLM_MAX_LORA_RANKS
from grpo.config import resolve_path
from grpo.config.run import UNRESOLVED, value_at
from grpo.config.sections import InferenceConfig, LoRAConfig, lora_served_merged


def lora_problems(values: dict) -> list[str]:
    """Problems of ``training.lora``, or none when the run trains every weight.

    Values of the wrong type are skipped (the config's own checks report them).

    Returns:
        list[str]: Each problem as ``key: what is wrong``: a rank vLLM cannot serve, an
        ``inference.engine_args`` that turns LoRA off or caps the rank below it, a target the
        model folder has no weight for.
    """
    lora = value_at(values, "training.lora", (dict,))
    if lora is None:
        return []
    problems = []
    rank = value_at(lora, "rank", (int,))
    serve = value_at(lora, "serve", (str,)) or LoRAConfig.model_fields["serve"].default
    collector_gpus = value_at(values, "inference.num_gpus", (int, float))
    if collector_gpus is None:
        collector_gpus = InferenceConfig.model_fields["num_gpus"].default
    # Served merged, the engine runs without LoRA: vLLM's LoRA limits and switch do not apply.
    if not lora_served_merged(serve, on_cpu=not collector_gpus):
        problems += _adapter_serving_problems(values, rank)
    model_path = values.get("base_model_path")
    targets = lora.get("target_modules")
    if isinstance(model_path, str) and model_path and isinstance(targets, list):
        weights = _layer_weight_names(resolve_path(model_path, fall_back_to_repo=True))
        if weights is not None:
            missing = [
                target
                for target in targets
                if target in _HF_MODULES
                and f"model.layers.0.{_HF_MODULES[target]}.weight" not in weights
            ]
            if missing:
                problems.append(
                    f"training.lora.target_modules: the model in {model_path} has no "
                    f"{', '.join(missing)} layer (no model.layers.0.<module>.weight in its "
                    "checkpoint)"
                )
    return problems


def _adapter_serving_problems(values: dict, rank: int | None) -> list[str]:
    """What keeps vLLM from serving the adapter: a rank above its largest, LoRA switched off
    in ``inference.engine_args``, a ``max_lora_rank`` it does not take or below the rank."""
    problems = []
    if rank is not None and rank > VLLM_MAX_LORA_RANKS[-1]:
        problems.append(
            f"training.lora.rank: {rank} is above {VLLM_MAX_LORA_RANKS[-1]}, the largest rank "
            "vLLM serves"
        )
    engine_args = value_at(values, "inference.engine_args", (dict,)) or {}
    if engine_args.get("enable_lora") is False:
        problems.append(
            "inference.engine_args.enable_lora: false, but training.lora trains an adapter the "
            "collectors serve through vLLM's LoRA support; remove the key, or serve it merged "
            "(training.lora.serve: merged)"
        )
    max_rank = engine_args.get("max_lora_rank")
    if max_rank is not None and max_rank is not UNRESOLVED:
        if max_rank not in VLLM_MAX_LORA_RANKS or isinstance(max_rank, bool):
            problems.append(
                f"inference.engine_args.max_lora_rank: {max_rank!r} is not one of vLLM's "
                f"max_lora_rank values ({', '.join(map(str, VLLM_MAX_LORA_RANKS))})"
            )
        elif rank is not None and rank > max_rank:
            problems.append(
                f"training.lora.rank: {rank} is above inference.engine_args.max_lora_rank "
                f"({max_rank}); raise max_lora_rank or remove it (the collectors then pick one)"
            )
    return problems


def _layer_weight_names(folder: Path) -> set[str] | None:
    """Tensor names of a model folder's checkpoint, from its index or safetensors header.

    None when they cannot be read (no folder, no or broken weights: `file_problems` reports
    those).
    """
    index = folder / "model.safetensors.index.json"
    try:
        if index.is_file():
            return set(json.loads(index.read_text())["weight_map"])
        with open(folder / "model.safetensors", "rb") as handle:
            # A safetensors file starts with the length of its JSON header (u64, little end).
            (length,) = struct.unpack("<Q", handle.read(8))
            return set(json.loads(handle.read(length))) - {"__metadata__"}
    except (OSError, ValueError, KeyError, struct.error):
        return None
