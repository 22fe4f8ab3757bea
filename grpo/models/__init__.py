"""Models, tokenizers and checkpoints in Hugging Face layout, through torchtune.

A model folder is a Hugging Face checkpoint; everything about the architecture is read from
its ``config.json``. The parts:

* `hf_folder`: read a folder (``config.json``, single or sharded safetensors weights).
* `hf_config`: architecture keys of ``config.json`` shared by the families (RoPE base and
  scaling in both the transformers 4 and 5 spellings).
* One module per model family, each with builder arguments from ``config.json`` (clear errors
  for unsupported features), HF -> torchtune conversion and the lazy torchtune -> HF iterator:
  `qwen2` (Qwen2 / Qwen2.5, torchtune's builder), `qwen3` (Qwen3 dense: per-head q/k norms
  before RoPE, explicit ``head_dim``; built from torchtune modules) and `llama` (Llama 3 / 3.1 / 3.2
  through torchtune's builders, with the ``llama3`` RoPE scaling and tied embeddings).
* `families`: the registry keyed by ``model_type`` (`SUPPORTED_MODEL_TYPES`) and the
  family-independent `hf_to_tune_state_dict`, `hf_weight_iterator` (the single tune -> HF path
  of checkpoints and weight sync) and `tune_to_hf_state_dict`.
* `build`: `build_model` (a torchtune ``TransformerDecoder`` with the folder's weights) and the
  config dtype names (`torch_dtype`).
* `tokenizer`: `load_tokenizer`, the folder's own tokenizer (``tokenizer.json`` through
  transformers, as vLLM loads it) and its chat template, for every family.
* `save`: `save_hf_checkpoint`, a torchtune state dict written as a folder, atomically.
* `lora`: low-rank adapters on a decoder (`apply_lora`, torchtune's ``LoRALinear``), their
  state-dict helpers, the PEFT exchange format (vLLM, ``grpo export``) and `merge_lora`.

Hidden states and the output projection for the loss live in `grpo.packing.logprobs`
(`model_hidden_states`, `output_projection_weight`).
"""

import torchao.quantization


def _patch_torchao_for_torchtune() -> None:
    """Let ``torchtune.training`` import with torchao 0.16.

    torchtune 0.6.1's ``torchtune.training.quantization`` imports ``int4_weight_only`` and
    ``int8_dynamic_activation_int4_weight`` from ``torchao.quantization``. torchao 0.16 removed
    these names, which were aliases of the config classes below, so without them every import
    of ``torchtune.training`` (checkpointers, ``set_default_dtype``, FSDP helpers) fails.
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
