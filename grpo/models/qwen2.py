"""Qwen2 / Qwen2.5 through torchtune: architecture from ``config.json`` and weight names.

torchtune's Qwen2 RoPE uses the HF rotate-half layout, so conversion is a renaming; with
``tie_word_embeddings`` neither side stores an output weight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torchtune.models.qwen2._convert_weights import qwen2_hf_to_tune, qwen2_tune_to_hf


def _config_value(hf_config: dict[str, Any], key: str) -> Any:
    if key not in hf_config:
        raise ValueError(f"model config has no {key!r}; a Qwen2 config.json needs it")
    return hf_config[key]


def _rope_theta(hf_config: dict[str, Any]) -> float:
    # 10000.0 is Qwen2Config's default.
    if "rope_theta" in hf_config:
        return float(hf_config["rope_theta"])
    rope_parameters = hf_config.get("rope_parameters") or {}
    return float(rope_parameters.get("rope_theta", 10_000.0))


def qwen2_builder_args(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Arguments of torchtune's ``qwen2`` component builder, read from an HF Qwen2 config.

    Raises:
        ValueError: If the config is not a Qwen2 config, lacks a key, or uses a feature
            torchtune's Qwen2 does not implement (RoPE scaling, sliding-window attention, a head
            dim other than ``hidden_size // num_attention_heads``).
    """
    model_type = hf_config.get("model_type")
    if model_type != "qwen2":
        raise ValueError(f"model_type must be 'qwen2' (Qwen2/Qwen2.5), got {model_type!r}")
    embed_dim = int(_config_value(hf_config, "hidden_size"))
    num_heads = int(_config_value(hf_config, "num_attention_heads"))
    head_dim = hf_config.get("head_dim")
    if head_dim is not None and head_dim * num_heads != embed_dim:
        raise ValueError(
            f"head_dim ({head_dim}) * num_attention_heads ({num_heads}) != hidden_size "
            f"({embed_dim}); torchtune's qwen2 derives head_dim as hidden_size // num_heads"
        )
    rope_parameters = hf_config.get("rope_parameters") or {}
    rope_type = rope_parameters.get("rope_type", "default")
    if hf_config.get("rope_scaling") or rope_type != "default":
        raise ValueError(
            f"RoPE scaling (rope_scaling={hf_config.get('rope_scaling')!r}, "
            f"rope_type={rope_type!r}) is not supported by torchtune's qwen2"
        )
    if hf_config.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported by torchtune's qwen2")
    return {
        "vocab_size": int(_config_value(hf_config, "vocab_size")),
        "num_layers": int(_config_value(hf_config, "num_hidden_layers")),
        "num_heads": num_heads,
        "num_kv_heads": int(hf_config.get("num_key_value_heads") or num_heads),
        "embed_dim": embed_dim,
        "intermediate_dim": int(_config_value(hf_config, "intermediate_size")),
        "max_seq_len": int(_config_value(hf_config, "max_position_embeddings")),
        "rope_base": _rope_theta(hf_config),
        "norm_eps": float(hf_config.get("rms_norm_eps", 1e-6)),
        # Qwen2Config's default is False; Qwen2.5 0.5B-3B set it to true, 7B+ to false.
        "tie_word_embeddings": bool(hf_config.get("tie_word_embeddings", False)),
    }


def _conversion_args(hf_config: dict[str, Any]) -> dict[str, Any]:
    args = qwen2_builder_args(hf_config)
    return {
        "num_heads": args["num_heads"],
        "num_kv_heads": args["num_kv_heads"],
        "dim": args["embed_dim"],
        "tie_word_embeddings": args["tie_word_embeddings"],
    }


def hf_to_tune_state_dict(
    state_dict: dict[str, torch.Tensor], hf_config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Rename an HF Qwen2 state dict to torchtune names (tensors are not copied); a tied
    ``lm_head.weight`` and old checkpoints' rotary ``inv_freq`` buffers are dropped.

    Raises:
        ValueError: If a key has no torchtune counterpart, or the config is not Qwen2.
    """
    args = _conversion_args(hf_config)
    try:
        return qwen2_hf_to_tune(state_dict, **args)
    except Exception as err:  # torchtune raises a bare Exception naming the unknown key
        raise ValueError(f"cannot convert HF Qwen2 state dict to torchtune: {err}") from err


def tune_to_hf_converter(
    hf_config: dict[str, Any],
) -> Callable[[str, torch.Tensor], tuple[str, torch.Tensor]]:
    """The torchtune -> HF conversion of one Qwen2 weight: ``(tune_name, tensor) -> (hf_name,
    tensor)``, a renaming that raises for an unknown name."""
    args = _conversion_args(hf_config)

    def convert(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        ((hf_name, hf_tensor),) = qwen2_tune_to_hf({name: tensor}, **args).items()
        return hf_name, hf_tensor

    return convert
