"""Checks of the files a config names: the model folder, the run folder, the resume target.

They read the disk (a model's ``config.json``, a probe file in ``output_dir``, a checkpoint's
``state.json``), so they run where a run is about to start (``grpo run``, ``grpo validate``),
not whenever a config is read.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from grpo.choices import MODEL_TYPES
from grpo.config import RunConfig, resolve_path
from grpo.config.run import environment_context, longest_sequence, value_at
from grpo.run_folder import STATE_FILE, find_checkpoint, run_records

# Files a model folder must hold; weights are checked separately (*.safetensors).
MODEL_FILES = ("config.json", "tokenizer.json")


def model_config_file(model_path: str) -> Path | None:
    """A model folder's ``config.json``, or None where the folder or the file is missing.

    The memory plan reads nothing else, so a folder holding only ``config.json`` will do.
    """
    path = resolve_path(model_path, fall_back_to_repo=True) / "config.json"
    return path if path.is_file() else None


def file_problems(values: dict, this_machine: bool = True) -> list[str]:
    """Problems of the model folder, the run folder and the resume target a config names.

    Args:
        this_machine (bool): The run starts here: its model folder must hold the weights and
            the tokenizer. False (planning a run elsewhere): only the model's ``config.json``
            is read (`model_config_file`).

    Returns:
        list[str]: Each problem as ``key: what is wrong``.
    """
    problems: list[str] = []
    model_path = values.get("base_model_path")
    if isinstance(model_path, str) and model_path and not this_machine:
        config_path = model_config_file(model_path)
        if config_path is None:
            folder = resolve_path(model_path, fall_back_to_repo=True)
            where = "has no config.json" if folder.is_dir() else "does not exist"
            problems.append(
                f"base_model_path: {folder} {where}; the memory plan reads only the model's "
                "config.json: put that file (from the model's hub page) in a folder and give "
                "base_model_path=FOLDER. A hub name is not looked up, and nothing is downloaded"
            )
        else:
            _check_model_config(config_path, values, problems)
    elif isinstance(model_path, str) and model_path:
        folder = resolve_path(model_path, fall_back_to_repo=True)
        if not folder.is_dir():
            problems.append(f"base_model_path: model folder {folder} does not exist")
        else:
            missing = [name for name in MODEL_FILES if not (folder / name).is_file()]
            if not any(folder.glob("*.safetensors")):
                missing.append("*.safetensors")
            if missing:
                problems.append(
                    f"base_model_path: {folder} lacks {', '.join(missing)} (expected a "
                    "Hugging Face model folder)"
                )
            _check_model_config(folder / "config.json", values, problems)
    output_dir = values.get("output_dir")
    if isinstance(output_dir, str) and output_dir:
        problem = _unwritable(resolve_path(output_dir))
        if problem:
            problems.append(f"output_dir: {problem}")
    resume = values.get("resume_from_checkpoint")
    if resume is True and isinstance(output_dir, str) and output_dir:
        try:
            find_checkpoint(resolve_path(output_dir), True)
        except FileNotFoundError:
            problems.append(
                f"resume_from_checkpoint: true, but {resolve_path(output_dir)} holds no "
                "checkpoint yet (no checkpoints/latest); start fresh with "
                "resume_from_checkpoint=false, or give a checkpoint folder"
            )
    elif isinstance(resume, str) and resume:
        path = resolve_path(resume)
        if not path.exists():
            problems.append(f"resume_from_checkpoint: {path} does not exist")
        elif not (path / STATE_FILE).is_file():
            problems.append(
                f"resume_from_checkpoint: {path} is not a checkpoint folder (no {STATE_FILE})"
            )
    return problems


def _unwritable(folder: Path) -> str | None:
    """Why a run could not write into `folder` (created if absent), or None if it can.

    Tries a file in the folder, or in its nearest existing parent, and removes it at once.
    """
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a folder; the run folder {folder} cannot be made"
    try:
        handle, probe = tempfile.mkstemp(prefix=".grpo-write-check-", dir=existing)
    except OSError as exc:
        where = "" if existing == folder else f" (its nearest existing parent {existing})"
        return f"{folder} is not writable{where}: {exc.strerror or exc}"
    os.close(handle)
    os.unlink(probe)
    return None


def _check_model_config(config_path: Path, values: dict, problems: list[str]) -> None:
    if not config_path.is_file():
        return
    try:
        model_config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        problems.append(f"base_model_path: {config_path} is not valid JSON: {exc}")
        return
    model_type = model_config.get("model_type")
    if model_type is not None and model_type not in MODEL_TYPES:
        problems.append(
            f"base_model_path: {config_path} has model_type {model_type!r}; supported model "
            f"types: {', '.join(MODEL_TYPES)}"
        )
    max_positions = model_config.get("max_position_embeddings")
    if not isinstance(max_positions, int) or isinstance(max_positions, bool):
        return
    from_config = longest_sequence(values)
    if from_config is None:
        # Nothing in the config bounds the sequences: the model's context does, and one
        # micro-batch must still hold the longest.
        longest = longest_sequence(values, max_positions)
        budget = value_at(values, "target_tokens_per_batch", (int,))
        if longest is not None and budget is not None and budget < longest[0]:
            from grpo.envs.preflight import bound_advice  # no torch

            problems.append(
                f"target_tokens_per_batch: {budget} cannot hold the longest sequence, "
                f"{longest[1]} in {config_path}; set " + bound_advice(values.get("environment"))
            )
    elif isinstance(values.get("environment"), dict):
        context = environment_context(values)
        if context is not None and context[0] > max_positions:
            problems.append(
                f"{context[2]}: {context[1]} exceeds the model's max_position_embeddings "
                f"({max_positions}) in {config_path}"
            )
    elif from_config[0] > max_positions:
        key = (
            "inference.max_generated_tokens"
            if value_at(values, "inference.max_prompt_tokens", (int,)) is not None
            else "inference.engine_args.max_model_len"
        )
        problems.append(
            f"{key}: {from_config[1]} exceeds the model's max_position_embeddings "
            f"({max_positions}) in {config_path}"
        )


def used_output_dir_problem(cfg: RunConfig) -> str | None:
    """Why a run of ``cfg`` may not start in its ``output_dir``, or None if it may.

    A fresh run into a folder that holds a run (`grpo.run_folder.RUN_RECORDS`) would append
    to its metrics, ledger and W&B history; it must resume that run or move it aside
    (``overwrite_output_dir``).
    """
    if cfg.resume_from_checkpoint or cfg.overwrite_output_dir:
        return None
    folder = resolve_path(cfg.output_dir)
    records = run_records(folder)
    if not records:
        return None
    return (
        f"output_dir: {folder} already holds a run ({', '.join(records)}); continue it with "
        "resume_from_checkpoint=true, move it aside with overwrite_output_dir=true, or choose "
        "another output_dir"
    )
