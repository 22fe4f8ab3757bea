"""Models, tokenizers and checkpoints in Hugging Face layout, through torchtune.

Everything about a model's architecture is read from its folder's ``config.json``; one module
per family (`qwen2`, `qwen3`, `llama`) converts weights both ways.
"""

import torchao.quantization


def _patch_torchao_for_torchtune() -> None:
    """Let ``torchtune.training`` import with torchao 0.16.

    torchtune 0.6.1 imports ``int4_weight_only`` and ``int8_dynamic_activation_int4_weight``,
    aliases that torchao 0.16 removed; without them every ``torchtune.training`` import fails.
    """
    aliases = {
        "int4_weight_only": "Int4WeightOnlyConfig",
        "int8_dynamic_activation_int4_weight": "Int8DynamicActivationInt4WeightConfig",
    }
    for old_name, config_name in aliases.items():
        if not hasattr(torchao.quantization, old_name):
            setattr(torchao.quantization, old_name, getattr(torchao.quantization, config_name))


_patch_torchao_for_torchtune()

# The submodules import torchtune, which needs the aliases above first.
from grpo.models.build import (  # noqa: E402
    DTYPES,
    SUPPORTED_MODEL_TYPES,
    build_model,
    torch_dtype,
)
from grpo.models.families import (  # noqa: E402
    FAMILIES,
    family_of,
    hf_to_tune_state_dict,
    hf_weight_iterator,
    tune_to_hf_state_dict,
)
from grpo.models.hf_folder import (  # noqa: E402
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX_FILE,
    load_hf_config,
    load_hf_state_dict,
)
from grpo.models.llama import llama_builder_args  # noqa: E402
from grpo.models.lora import (  # noqa: E402
    LORA_MODULES,
    adapter_state_dict,
    apply_lora,
    base_state_dict,
    is_adapter_key,
    load_peft_adapter,
    merge_lora,
    peft_adapter_config,
    peft_adapter_state_dict,
    reset_lora_parameters,
    save_peft_adapter,
    trainable_parameters,
    tune_adapter_state_dict,
)
from grpo.models.qwen2 import qwen2_builder_args  # noqa: E402
from grpo.models.qwen3 import qwen3_builder_args  # noqa: E402
from grpo.models.save import save_hf_checkpoint  # noqa: E402
from grpo.models.tokenizer import Tokenizer, load_tokenizer  # noqa: E402

__all__ = [
    "DTYPES",
    "FAMILIES",
    "LORA_MODULES",
    "SAFETENSORS_FILE",
    "SAFETENSORS_INDEX_FILE",
    "SUPPORTED_MODEL_TYPES",
    "Tokenizer",
    "adapter_state_dict",
    "apply_lora",
    "base_state_dict",
    "build_model",
    "family_of",
    "hf_to_tune_state_dict",
    "hf_weight_iterator",
    "is_adapter_key",
    "load_hf_config",
    "load_hf_state_dict",
    "llama_builder_args",
    "load_peft_adapter",
    "load_tokenizer",
    "merge_lora",
    "peft_adapter_config",
    "peft_adapter_state_dict",
    "qwen2_builder_args",
    "qwen3_builder_args",
    "reset_lora_parameters",
    "save_hf_checkpoint",
    "save_peft_adapter",
    "torch_dtype",
    "trainable_parameters",
    "tune_adapter_state_dict",
    "tune_to_hf_state_dict",
]
