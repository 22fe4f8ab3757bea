"""Export a LoRA checkpoint: its PEFT adapter folder, or a plain model with the adapter merged.

``grpo export CHECKPOINT_DIR --peft OUT`` copies the checkpoint's ``adapter/`` folder;
``--merged OUT`` writes a Hugging Face folder with ``W + (alpha / r) B A`` in place of each
adapted weight, which loads without LoRA support (docs/training.md).
"""

from __future__ import annotations

import os
from pathlib import Path

from grpo.config import LoRAConfig
from grpo.models import (
    hf_to_tune_state_dict,
    load_hf_config,
    load_hf_state_dict,
    save_hf_checkpoint,
)
from grpo.models.lora import (
    ADAPTER_CONFIG_FILE,
    load_peft_adapter,
    merge_lora,
    save_peft_adapter,
    tune_adapter_state_dict,
)
from grpo.run_folder import CHECKPOINTS_DIR, LATEST_FILE
from grpo.workers.training_checkpoint import ADAPTER_SUBDIR

# adapter_config.json settings that change what the adapter computes, with their plain LoRA
# value: merging ignores them, so an adapter that sets another value is refused.
_PLAIN_LORA = {
    "use_rslora": False,
    "use_dora": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "bias": "none",
}


class ExportError(Exception):
    """An export cannot be done; the message is one line that names the folder or file."""


def find_adapter(checkpoint_dir: str | os.PathLike) -> Path:
    """The PEFT folder of a checkpoint (its ``adapter/``), or the folder itself if it is one.

    A run folder, or its ``checkpoints/latest`` file, stands for the newest checkpoint.

    Raises:
        ExportError: If the folder does not exist or holds no adapter.
    """
    folder = Path(checkpoint_dir)
    if folder.is_file() and folder.name == LATEST_FILE:  # names the newest checkpoint
        folder = folder.parent / folder.read_text().strip()
    elif (folder / CHECKPOINTS_DIR / LATEST_FILE).is_file():  # a run folder
        folder = (
            folder / CHECKPOINTS_DIR / (folder / CHECKPOINTS_DIR / LATEST_FILE).read_text().strip()
        )
    if not folder.is_dir():
        raise ExportError(f"checkpoint folder {folder} does not exist")
    for candidate in (folder, folder / ADAPTER_SUBDIR):
        if (candidate / ADAPTER_CONFIG_FILE).is_file():
            return candidate
    raise ExportError(
        f"{folder} holds no LoRA adapter (no {ADAPTER_SUBDIR}/{ADAPTER_CONFIG_FILE} or "
        f"{ADAPTER_CONFIG_FILE}); only checkpoints of runs with training.lora can be exported"
    )


def export_checkpoint(
    checkpoint_dir: str | os.PathLike,
    *,
    peft_dir: str | os.PathLike | None = None,
    merged_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Write a checkpoint's adapter as a PEFT folder and/or merged into its base model.

    Every output folder is checked before anything is written, and each is written atomically.

    Args:
        checkpoint_dir: A LoRA checkpoint folder, a PEFT adapter folder, or a run folder or
            its ``checkpoints/latest`` (the newest checkpoint).
        merged_dir: Where to write the merged Hugging Face folder (base weights from the
            adapter's ``base_model_name_or_path``).

    Returns:
        list[Path]: The folders written (PEFT first).

    Raises:
        ExportError: If no output is given, the checkpoint or its adapter or base model is
            missing, an output folder exists (without ``overwrite``) or cannot be written, or
            the adapter does not fit the base model.
    """
    outputs = [Path(out) for out in (peft_dir, merged_dir) if out is not None]
    if not outputs:
        raise ExportError("nothing to export: give --peft OUT_DIR and/or --merged OUT_DIR")
    adapter_dir = find_adapter(checkpoint_dir)
    for out in outputs:
        _check_output(out, adapter_dir, overwrite)
    try:
        tensors, adapter_config = load_peft_adapter(adapter_dir)
    except (OSError, ValueError) as err:  # a truncated safetensors file, broken JSON
        raise ExportError(f"cannot read the adapter in {adapter_dir}: {_first_line(err)}") from err
    base = _merge_base(adapter_dir, adapter_config) if merged_dir is not None else None
    written = []
    if peft_dir is not None:
        written.append(save_peft_adapter(peft_dir, tensors, adapter_config))
    if merged_dir is not None:
        assert base is not None
        written.append(_export_merged(adapter_dir, tensors, adapter_config, base, merged_dir))
    return written


def _check_output(out: Path, adapter_dir: Path, overwrite: bool) -> None:
    if out.resolve() in (adapter_dir.resolve(), *adapter_dir.resolve().parents):
        raise ExportError(f"output folder {out} would replace the checkpoint it exports")
    if out.exists() and not out.is_dir():
        raise ExportError(f"output {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"output folder {out} exists and is not empty; pass --overwrite")
    # Written as a sibling and renamed: the nearest existing ancestor must take new entries.
    parent = out.resolve().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ExportError(f"output folder {out} cannot be made: {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"output folder {out} cannot be written ({parent} is not writable)")


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def _merge_base(adapter_dir: Path, adapter_config: dict) -> str:
    """The base model folder of an adapter that --merged can merge; ExportError otherwise."""
    base = adapter_config.get("base_model_name_or_path")
    if not isinstance(base, str) or not (Path(base) / "config.json").is_file():
        raise ExportError(
            f"base_model_name_or_path {base!r} of {adapter_dir / ADAPTER_CONFIG_FILE} is not a "
            "local model folder; --merged needs the base model's weights there"
        )
    changed = [key for key, plain in _PLAIN_LORA.items() if adapter_config.get(key, plain) != plain]
    if changed or "r" not in adapter_config or "lora_alpha" not in adapter_config:
        what = f"sets {', '.join(changed)}" if changed else "lacks r or lora_alpha"
        raise ExportError(
            f"{adapter_dir / ADAPTER_CONFIG_FILE} {what}; --merged merges plain LoRA adapters only"
        )
    return base


def _export_merged(
    adapter_dir: Path, tensors: dict, adapter_config: dict, base: str, out: str | os.PathLike
) -> Path:
    try:
        # Only the scale alpha / r matters to the merge; the targets are those the tensors name.
        lora = LoRAConfig(rank=adapter_config["r"], alpha=adapter_config["lora_alpha"])
        hf_config = load_hf_config(base)
        tune_state = hf_to_tune_state_dict(load_hf_state_dict(base), hf_config)
        adapter = tune_adapter_state_dict(tensors, hf_config)
        # An adapter of a layer the base lacks fails here, naming it (no base weight).
        merged = merge_lora({**tune_state, **adapter}, lora)
        return save_hf_checkpoint(merged, base, out)
    except (OSError, ValueError, RuntimeError) as err:  # RuntimeError: shapes that do not fit
        raise ExportError(f"cannot merge {adapter_dir} into {base}: {_first_line(err)}") from err
