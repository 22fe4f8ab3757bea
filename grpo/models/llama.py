"""Llama 3.x through torchtune's llama3 / llama3_1 / llama3_2 builders: config, weight names.

The builders' ``Llama3ScaledRoPE`` takes only ``scale_factor`` and keeps Llama 3.1's other
defaults, so `llama` rebuilds it from every parameter of the config's ``rope_scaling``. HF
stores q/k rows permuted for its rotate-half RoPE; conversion undoes and redoes that exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torchtune.models import convert_weights
from torchtune.models.llama3 import llama3
from torchtune.models.llama3_1 import llama3_1
from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
from torchtune.models.llama3_2 import llama3_2
from torchtune.modules import RotaryPositionalEmbeddings, TransformerDecoder

from grpo.models.hf_config import required_key, rope_scaling, rope_theta

# Keys of a `rope_type: llama3` scaling and the Llama3ScaledRoPE argument each one sets.
_LLAMA3_ROPE_KEYS = {
    "factor": "scale_factor",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "original_max_position_embeddings": "old_context_len",
}


def llama(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    rope_base: float = 500_000.0,
    norm_eps: float = 1e-5,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, float] | None = None,
) -> TransformerDecoder:
    """A Llama 3.x decoder from torchtune's builders, with the config's exact RoPE.

    Args:
        embed_dim (int): Hidden size; the head dim is ``embed_dim // num_heads``.
        rope_scaling (dict[str, float] | None): ``Llama3ScaledRoPE`` arguments, or None for
            plain RoPE.
    """
    args = {
        "vocab_size": vocab_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "embed_dim": embed_dim,
        "intermediate_dim": intermediate_dim,
        "max_seq_len": max_seq_len,
        "rope_base": rope_base,
        "norm_eps": norm_eps,
    }
    head_dim = embed_dim // num_heads
    if rope_scaling is None:
        if not tie_word_embeddings:
            return llama3(**args)  # Llama 3.0: plain RoPE, untied
        model = llama3_2(**args, tie_word_embeddings=True)
        rope = RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=rope_base)
    else:
        scale_factor = rope_scaling["scale_factor"]
        if tie_word_embeddings:
            model = llama3_2(**args, scale_factor=scale_factor, tie_word_embeddings=True)
        else:
            model = llama3_1(**args, scale_factor=scale_factor)
        rope = Llama3ScaledRoPE(
            dim=head_dim, max_seq_len=max_seq_len, base=rope_base, **rope_scaling
        )
    # One RoPE module shared by every layer, as the builders do.
    for layer in model.layers:
        layer.attn.pos_embeddings = rope
    return model


def llama_builder_args(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Arguments of `llama`, read from an HF Llama 3.x config.

    Raises:
        ValueError: If the config is not a Llama config, lacks a key, or uses a feature not
            implemented here (attention or MLP biases, a ``head_dim`` other than
            ``hidden_size // num_attention_heads``, a RoPE scaling other than ``llama3``).
    """
    model_type = hf_config.get("model_type")
    if model_type != "llama":
        raise ValueError(f"model_type must be 'llama' (Llama 3.x), got {model_type!r}")
    embed_dim = int(required_key(hf_config, "hidden_size", "Llama"))
    num_heads = int(required_key(hf_config, "num_attention_heads", "Llama"))
    num_kv_heads = int(hf_config.get("num_key_value_heads") or num_heads)
    if embed_dim % num_heads != 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must divide hidden_size ({embed_dim}) and be a "
            f"multiple of num_key_value_heads ({num_kv_heads})"
        )
    head_dim = hf_config.get("head_dim")
    if head_dim is not None and head_dim * num_heads != embed_dim:
        raise ValueError(
            f"head_dim ({head_dim}) * num_attention_heads ({num_heads}) != hidden_size "
            f"({embed_dim}); torchtune's llama3 derives head_dim as hidden_size // num_heads"
        )
    for key in ("attention_bias", "mlp_bias"):
        if hf_config.get(key):
            raise ValueError(f"{key}=true is not supported for llama (Llama 3 has no biases)")
    scaling = rope_scaling(hf_config)
    scaled_rope = None
    if scaling is not None:
        if scaling["rope_type"] != "llama3":
            raise ValueError(
                f"rope_scaling of rope_type {scaling['rope_type']!r} is not supported for "
                "llama; only 'llama3' (Llama 3.1/3.2) is"
            )
        missing = [key for key in _LLAMA3_ROPE_KEYS if key not in scaling]
        if missing:
            raise ValueError(f"rope_scaling {scaling!r} lacks {missing} (rope_type 'llama3')")
        scaled_rope = {arg: float(scaling[key]) for key, arg in _LLAMA3_ROPE_KEYS.items()}
    return {
        "vocab_size": int(required_key(hf_config, "vocab_size", "Llama")),
        "num_layers": int(required_key(hf_config, "num_hidden_layers", "Llama")),
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "embed_dim": embed_dim,
        "intermediate_dim": int(required_key(hf_config, "intermediate_size", "Llama")),
        "max_seq_len": int(required_key(hf_config, "max_position_embeddings", "Llama")),
        "rope_base": rope_theta(hf_config, default=10_000.0),
        "norm_eps": float(hf_config.get("rms_norm_eps", 1e-6)),
        # LlamaConfig's default is False; Llama 3.2 1B/3B set it to true.
        "tie_word_embeddings": bool(hf_config.get("tie_word_embeddings", False)),
        "rope_scaling": scaled_rope,
    }


def _conversion_args(hf_config: dict[str, Any]) -> tuple[dict[str, int], bool]:
    args = llama_builder_args(hf_config)
    shape = {
        "num_heads": args["num_heads"],
        "num_kv_heads": args["num_kv_heads"],
        "dim": args["embed_dim"],
        "head_dim": args["embed_dim"] // args["num_heads"],
    }
    return shape, args["tie_word_embeddings"]


def hf_to_tune_state_dict(
    state_dict: dict[str, torch.Tensor], hf_config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Convert an HF Llama state dict to torchtune's (q/k rows permuted, the rest renamed); a
    tied ``lm_head.weight`` is dropped.

    Raises:
        ValueError: If a key has no torchtune counterpart, or the config is not Llama.
    """
    shape, tied = _conversion_args(hf_config)
    if tied:
        state_dict = {name: t for name, t in state_dict.items() if name != "lm_head.weight"}
    try:
        return convert_weights.hf_to_tune(state_dict, **shape)
    except Exception as err:  # torchtune raises a bare Exception naming the unknown key
        raise ValueError(f"cannot convert HF Llama state dict to torchtune: {err}") from err


def tune_to_hf_converter(
    hf_config: dict[str, Any],
) -> Callable[[str, torch.Tensor], tuple[str, torch.Tensor]]:
    """The torchtune -> HF conversion of one Llama weight: ``(tune_name, tensor) -> (hf_name,
    tensor)``; q/k come out as new tensors in HF's row order, the rest keep their tensor."""
    shape, _ = _conversion_args(hf_config)

    def convert(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        ((hf_name, hf_tensor),) = convert_weights.tune_to_hf({name: tensor}, **shape).items()
        return hf_name, hf_tensor

    return convert
