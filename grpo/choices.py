"""Allowed values of the run config's enumerated options, each written once.

The config sections (`grpo.config.sections`) type their options with these `Literal`s, and the
components that take the same values (the loss, attention, the model builder, the weight
transports) read their tuples from here, so a config that validates is a config the components
accept. Imports nothing but `typing`.
"""

from __future__ import annotations

from typing import Literal, get_args

DType = Literal["fp32", "bf16", "float32", "bfloat16"]
"""Parameter dtypes of the reference and training models (``ref.dtype``, ``training.dtype``)."""

MaskKind = Literal["auto", "dense", "varlen", "flex"]
"""Attention of packed batches: auto (flex on CUDA, varlen elsewhere), dense, varlen, flex."""

KLEstimator = Literal["k1", "k2", "k3"]
"""Estimators of the KL divergence to the reference model."""

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
"""How per-token losses become the batch loss."""

Level = Literal["token", "sequence"]
"""Token- or sequence-level importance ratios and mismatch corrections."""

Correction = Literal["none", "tis", "mis", "icepop"]
"""Corrections of the vLLM/trainer logprob mismatch: none, truncated importance sampling, masked
importance sampling, IcePop (`grpo.objective.loss.GRPOLoss` gives each formula)."""

WeightTransportKind = Literal["collective", "object_store"]
"""How new weights travel from the trainer to the collectors."""

WeightUpdateMode = Literal["in_flight", "in_flight_keep_kv", "between_batches"]
"""When a collector loads new weights: between two decode steps of a running batch (its running
sequences prefilled again with them, or keeping the KV cache the old weights computed), or only
between generation batches."""

LoRATarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Linear layers a LoRA adapter can wrap, by their Hugging Face / PEFT / vLLM names (the same in
every supported family)."""

LogLevel = Literal["info", "debug"]
"""Terminal verbosity of ``grpo run``."""

WandbMode = Literal["online", "offline", "disabled"]
"""W&B modes."""

ModelType = Literal["qwen2", "qwen3", "llama"]
"""``model_type`` values of ``config.json`` that `grpo.models.build_model` builds."""

DTYPE_CHOICES: tuple[str, ...] = get_args(DType)
MASK_KIND_CHOICES: tuple[str, ...] = get_args(MaskKind)
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
LEVELS: tuple[str, ...] = get_args(Level)
CORRECTIONS: tuple[str, ...] = get_args(Correction)
TRANSPORTS: tuple[str, ...] = get_args(WeightTransportKind)
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)
WANDB_MODES: tuple[str, ...] = get_args(WandbMode)
MODEL_TYPES: tuple[str, ...] = get_args(ModelType)
LORA_TARGETS: tuple[str, ...] = get_args(LoRATarget)

# Where each LoRA target sits in a Hugging Face decoder layer (``model.layers.{i}.<path>``).
LORA_HF_MODULES: dict[str, str] = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}

# The values vLLM's ``max_lora_rank`` accepts (``vllm.config.lora.MaxLoRARanks``); an adapter
# of any rank up to the engine's loads.
VLLM_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)
