"""Qwen2 / Qwen2.5 through torchtune: architecture from ``config.json`` and weight names.

torchtune and vLLM/HF name the same Qwen2 tensors differently (``layers.0.attn.q_proj.weight``
vs ``model.layers.0.self_attn.q_proj.weight``). Qwen2 needs no permutation of q/k
(torchtune's Qwen2 RoPE uses the HF rotate-half layout), so conversion is a renaming done by
torchtune's ``qwen2_hf_to_tune`` / ``qwen2_tune_to_hf``, plus the tied embedding rule: with
``tie_word_embeddings`` the HF checkpoint stores no ``lm_head.weight`` and the torchtune model
has no ``output.weight`` (its output is a ``TiedLinear`` on the embedding).
`tune_to_hf_converter` converts one weight for `grpo.models.hf_weight_iterator`, the single
tune->HF path of every family, used by `grpo.models.save_hf_checkpoint` and by weight sync to
vLLM (``reload_weights(weights_iterator=...)``). Everything is read from ``config.json``, so
the same code serves the tiny test model and Qwen2/Qwen2.5 checkpoints of any size.
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
    # transformers < 5 writes a top-level `rope_theta`; transformers 5 nests it in
    # `rope_parameters`. 10000.0 is Qwen2Config's default when neither is present.
    if "rope_theta" in hf_config:
        return float(hf_config["rope_theta"])
    rope_parameters = hf_config.get("rope_parameters") or {}
    return float(rope_parameters.get("rope_theta", 10_000.0))


def qwen2_builder_args(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Arguments of torchtune's ``qwen2`` component builder, read from an HF Qwen2 config.

    Args:
        hf_config (dict[str, Any]): Parsed ``config.json``.

    Returns:
        dict[str, Any]: ``vocab_size``, ``num_layers``, ``num_heads``, ``num_kv_heads``,
        ``embed_dim``, ``intermediate_dim``, ``max_seq_len``, ``rope_base``, ``norm_eps`` and
        ``tie_word_embeddings``.

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
    """Rename an HF Qwen2 state dict to torchtune names (tensors are not copied).

    ``lm_head.weight`` is dropped when the config ties embeddings, and rotary ``inv_freq``
    buffers of old checkpoints are dropped.

    Args:
        state_dict (dict[str, torch.Tensor]): Full HF state dict (all shards merged).
        hf_config (dict[str, Any]): Parsed ``config.json``.

    Returns:
        dict[str, torch.Tensor]: State dict for torchtune's ``qwen2`` model.

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
    """The torchtune -> HF conversion of one Qwen2 weight, for `grpo.models.hf_weight_iterator`.

    Qwen2 needs no permutation of q/k, so a weight keeps its tensor object and changes name.

    Args:
        hf_config (dict[str, Any]): Parsed ``config.json``.

    Returns:
        Callable: ``(tune_name, tensor) -> (hf_name, tensor)``; raises for an unknown name.
    """
    args = _conversion_args(hf_config)

    def convert(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
        ((hf_name, hf_tensor),) = qwen2_tune_to_hf({name: tensor}, **args).items()
        return hf_name, hf_tensor

    return convert
