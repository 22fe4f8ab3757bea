"""Reading architecture keys from a Hugging Face ``config.json``, shared by the model families.

transformers < 5 writes ``rope_theta`` and ``rope_scaling`` at the top level; transformers 5
nests both in ``rope_parameters`` (``{"rope_type": ..., "rope_theta": ..., "factor": ...}``).
`rope_theta` and `rope_scaling` read either spelling.
"""

from __future__ import annotations

from typing import Any


def required_key(hf_config: dict[str, Any], key: str, family: str) -> Any:
    """``hf_config[key]``; ValueError naming the key and the family if it is missing.

    Args:
        hf_config (dict[str, Any]): Parsed ``config.json``.
        key (str): The key.
        family (str): Family name for the message, e.g. ``"Qwen3"``.

    Returns:
        Any: The value.

    Raises:
        ValueError: If the key is missing.
    """
    if key not in hf_config:
        raise ValueError(f"model config has no {key!r}; a {family} config.json needs it")
    return hf_config[key]


def rope_theta(hf_config: dict[str, Any], default: float) -> float:
    """The RoPE base: top-level ``rope_theta``, else ``rope_parameters.rope_theta``, else default.

    Args:
        hf_config (dict[str, Any]): Parsed ``config.json``.
        default (float): The family's default (its transformers config class's).

    Returns:
        float: The base.
    """
    if "rope_theta" in hf_config:
        return float(hf_config["rope_theta"])
    rope_parameters = hf_config.get("rope_parameters") or {}
    return float(rope_parameters.get("rope_theta", default))


def rope_scaling(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """The RoPE scaling of a config, or None for plain RoPE.

    Args:
        hf_config (dict[str, Any]): Parsed ``config.json``.

    Returns:
        dict[str, Any] | None: The scaling parameters with ``rope_type`` set (old configs spell
        it ``type``); None when there is none or its type is ``default``.
    """
    scaling = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    return {**scaling, "rope_type": rope_type}
