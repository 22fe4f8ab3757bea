"""Reading architecture keys from a Hugging Face ``config.json``, shared by the model families.

The RoPE keys are read in either spelling: top level (transformers < 5) or nested in
``rope_parameters`` (transformers 5).
"""

from __future__ import annotations

from typing import Any


def required_key(hf_config: dict[str, Any], key: str, family: str) -> Any:
    """``hf_config[key]``; ValueError naming the key and the ``family`` if it is missing."""
    if key not in hf_config:
        raise ValueError(f"model config has no {key!r}; a {family} config.json needs it")
    return hf_config[key]


def rope_theta(hf_config: dict[str, Any], default: float) -> float:
    """The RoPE base: top-level ``rope_theta``, else ``rope_parameters.rope_theta``, else the
    family's ``default``."""
    if "rope_theta" in hf_config:
        return float(hf_config["rope_theta"])
    rope_parameters = hf_config.get("rope_parameters") or {}
    return float(rope_parameters.get("rope_theta", default))


def rope_scaling(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """The RoPE scaling parameters with ``rope_type`` set (old configs spell it ``type``), or
    None for plain RoPE (none, or type ``default``)."""
    scaling = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    return {**scaling, "rope_type": rope_type}
