"""Reading a Hugging Face model folder: ``config.json``, safetensors weights (single or sharded),
for any model family."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
# Files of a model folder that are weights: never copied by `save_hf_checkpoint`, which writes
# its own. Everything else at the top level (tokenizer, generation config, README) is copied.
WEIGHT_FILE_SUFFIXES = (
    ".safetensors",
    ".safetensors.index.json",
    ".bin",
    ".bin.index.json",
    ".pt",
    ".pth",
    ".ckpt",
)


def model_folder(model_dir: str | os.PathLike) -> Path:
    """``model_dir`` as a Path; FileNotFoundError naming it if it is not a folder."""
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist or is not a folder")
    return path


def required_file(model_dir: Path, name: str, what: str) -> Path:
    """``model_dir / name``; FileNotFoundError naming it as ``what`` if it is missing."""
    path = model_dir / name
    if not path.is_file():
        raise FileNotFoundError(f"{what} {str(path)!r} not found (model folder {str(model_dir)!r})")
    return path


def load_hf_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """Read ``config.json`` of a Hugging Face model folder.

    Raises:
        FileNotFoundError: If the folder or its ``config.json`` does not exist.
        ValueError: If ``config.json`` is not a JSON object.
    """
    path = required_file(model_folder(model_dir), "config.json", "model config")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"model config {str(path)!r} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise ValueError(f"model config {str(path)!r} must hold a JSON object")
    return config


def checkpoint_files(model_dir: Path) -> list[Path]:
    """Safetensors files of a model folder: the shards of the index, or the single file."""
    index_path = model_dir / SAFETENSORS_INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"checkpoint index {str(index_path)!r} has no 'weight_map'")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for path in files:
            if not path.is_file():
                raise FileNotFoundError(
                    f"shard {str(path)!r} listed in {str(index_path)!r} not found"
                )
        return files
    single = model_dir / SAFETENSORS_FILE
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no weights in model folder {str(model_dir)!r}: expected {SAFETENSORS_FILE} or "
        f"{SAFETENSORS_INDEX_FILE}"
    )


def load_hf_state_dict(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load all safetensors weights (single or sharded) of a model folder under their HF names,
    as one CPU state dict.

    Raises:
        FileNotFoundError: If the folder, the weights or a listed shard is missing.
    """
    state_dict: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_folder(model_dir)):
        state_dict.update(load_file(str(path)))
    return state_dict


def hf_weight_names(model_dir: Path) -> set[str]:
    """Tensor names stored in a folder's safetensors files, read from the headers only."""
    names: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            names.update(handle.keys())
    return names
