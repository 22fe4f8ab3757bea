"""What a resume may change: the config a checkpoint ran with, compared with the new one.

A resume runs the new config; most settings simply apply from the checkpoint's step on. The
settings in `FIXED_ON_RESUME` are those the checkpoint's state was made for, and a resume that
changes one is refused before anything starts, as is one that would train nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from grpo.config import resolve_path
from grpo.run_folder import CONFIG_FILE, STATE_FILE, find_checkpoint

# Setting -> why the checkpoint's state cannot go on under another value.
FIXED_ON_RESUME: dict[str, str] = {
    "base_model_path": "its weights are a training of this model, which is also the reference",
    "seed": "the collectors' prompt order and sampling seeds derive from it",
    "dataset": "the collectors' saved stream positions index this dataset",
    "orchestration.num_inference_workers": "each collector's stream position is saved for its "
    "own shard of the dataset",
    "training.optimizer._component_": "the saved optimizer state is this optimizer's",
    "training.lr_scheduler._component_": "the saved LR schedule is this schedule's",
    "training.ppo_epochs": "the LR schedule counts optimizer steps, ppo_epochs per training step",
    "training.lora": "the checkpoint holds what it trained: an adapter of these settings, or the "
    "whole model",
}


def _plain(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as its YAML file reads back (tuples as lists, ...), to compare like with like."""
    return yaml.safe_load(yaml.safe_dump(config, sort_keys=False))


def _at(config: dict[str, Any], key: str) -> Any:
    """The value at a dotted ``key``, None where a part of it is absent or null."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def resume_problems(config: dict[str, Any]) -> list[str]:
    """Why a resume of ``config`` cannot go on from its checkpoint, one ``key: ...`` line each.

    Returns:
        list[str]: Empty when ``config`` resumes nothing, its checkpoint cannot be found (the
        path checks report that), or the resume may go on. A checkpoint saved without its
        config (older runs) is checked for its step only.
    """
    resume, output_dir = config.get("resume_from_checkpoint"), config.get("output_dir")
    if not resume or not output_dir:
        return []
    try:
        checkpoint = find_checkpoint(resolve_path(output_dir), resume)
    except FileNotFoundError:
        return []
    if checkpoint is None or not (checkpoint / STATE_FILE).is_file():
        return []
    problems = []
    step = json.loads((checkpoint / STATE_FILE).read_text()).get("step")
    num_steps = _at(config, "orchestration.num_steps")
    if isinstance(step, int) and isinstance(num_steps, int) and num_steps <= step:
        problems.append(
            f"orchestration.num_steps: {num_steps} does not go beyond step {step} of the "
            f"checkpoint {checkpoint}, so the resume would train nothing; give a larger "
            "num_steps to extend the run"
        )
    saved_path = Path(checkpoint) / CONFIG_FILE
    if saved_path.is_file():
        saved, new = _plain(yaml.safe_load(saved_path.read_text())), _plain(config)
        for key, why in FIXED_ON_RESUME.items():
            before, after = _at(saved, key), _at(new, key)
            if before != after:
                problems.append(
                    f"{key}: the checkpoint {checkpoint} ran with {_short(before)}, this config "
                    f"has {_short(after)}; it cannot change on resume ({why}). Keep it, or "
                    "start a new run"
                )
    return problems


def _short(value: Any) -> str:
    """A value for a one-line message (a dataset node can be long)."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
