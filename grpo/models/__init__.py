"""Models, tokenizers and checkpoints in Hugging Face layout, through torchtune.

Everything about a model's architecture is read from its folder's ``config.json``; one module
per family (`qwen2`, `qwen3`, `llama`) converts weights both ways.

Names are imported on first use: a collector needs the tokenizer and the safetensors reader,
not torchtune and torchao (seconds of import per actor start).
"""

from __future__ import annotations

import importlib
from typing import Any

# Each public name and the submodule that defines it.
_MODULE_OF = {
    "DTYPES": "build",
    "FAMILIES": "families",
    "LORA_MODULES": "lora",
    "SAFETENSORS_FILE": "hf_folder",
    "SAFETENSORS_INDEX_FILE": "hf_folder",
    "SUPPORTED_MODEL_TYPES": "build",
    "Tokenizer": "tokenizer",
    "adapter_state_dict": "lora",
    "apply_lora": "lora",
    "base_state_dict": "lora",
    "build_model": "build",
    "family_of": "families",
    "hf_to_tune_state_dict": "families",
    "hf_weight_iterator": "families",
    "is_adapter_key": "lora",
    "llama_builder_args": "llama",
    "load_hf_config": "hf_folder",
    "load_hf_state_dict": "hf_folder",
    "load_peft_adapter": "lora",
    "load_tokenizer": "tokenizer",
    "merge_lora": "lora",
    "peft_adapter_config": "lora",
    "peft_adapter_state_dict": "lora",
    "qwen2_builder_args": "qwen2",
    "qwen3_builder_args": "qwen3",
    "reset_lora_parameters": "lora",
    "save_hf_checkpoint": "save",
    "save_peft_adapter": "lora",
    "torch_dtype": "build",
    "trainable_parameters": "lora",
    "tune_adapter_state_dict": "lora",
    "tune_to_hf_state_dict": "families",
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'grpo.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"grpo.models.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value
