"""The layout of a run folder (``output_dir``): where checkpoints live, what marks a run.

The one place that spells it out for the checkpointer, resumes, ``grpo validate`` and the
terminal. Imports nothing of grpo.
"""

from __future__ import annotations

import time
from pathlib import Path

CHECKPOINTS_DIR = "checkpoints"
"""The folder of a run's checkpoints, in its run folder."""
LATEST_FILE = "latest"
"""The file in `CHECKPOINTS_DIR` that names the newest checkpoint."""
STATE_FILE = "state.json"
"""The run state of a checkpoint (step, policy version, ...), in the checkpoint folder."""
CONFIG_FILE = "config.yaml"
"""The config a checkpoint's run ran with, in the checkpoint folder."""
WANDB_RUN_FILE = "wandb_run.json"
"""The W&B run a run logs to (id, name, project), which a resume goes on logging to."""

# What a run leaves in its folder; a folder holding any of them holds a run.
RUN_RECORDS = ("metrics.jsonl", "trained.jsonl", "scored.jsonl", CHECKPOINTS_DIR, "final")


def find_checkpoint(run_dir: Path, resume: bool | str) -> Path | None:
    """The checkpoint to resume from: ``true`` means the latest in ``run_dir``.

    Args:
        resume: ``resume_from_checkpoint``: false or None, true, or a folder.

    Returns:
        Path | None: The checkpoint folder; None when ``resume`` is false.

    Raises:
        FileNotFoundError: If ``resume`` is true and ``run_dir`` has no checkpoint, or a
            folder that is no checkpoint.
    """
    if resume is False or resume is None:
        return None
    if resume is True:
        latest = run_dir / CHECKPOINTS_DIR / LATEST_FILE
        if not latest.is_file():
            raise FileNotFoundError(
                f"resume_from_checkpoint=true but {latest} does not exist (no checkpoint saved "
                "in this output_dir yet)"
            )
        return run_dir / CHECKPOINTS_DIR / latest.read_text().strip()
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"resume_from_checkpoint: {path} is not a checkpoint folder")
    return path


def run_records(run_dir: Path) -> list[str]:
    """The records of an earlier run in ``run_dir`` (`RUN_RECORDS` present), in that order."""
    return [name for name in RUN_RECORDS if (run_dir / name).exists()]


def move_run_aside(run_dir: Path) -> Path | None:
    """Rename a folder that holds a run to ``<run_dir>.old-<time>``; nothing is deleted.

    Returns:
        Path | None: Where the old run went; None if ``run_dir`` held no run.
    """
    if not run_records(run_dir):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    suffix = 1
    while target.exists():
        suffix += 1
        target = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{suffix}")
    run_dir.rename(target)
    return target


def latest_checkpoint_text(run_dir: Path) -> str:
    """Where to resume from, for error messages: the latest checkpoint, or the start."""
    latest = run_dir / CHECKPOINTS_DIR / LATEST_FILE
    if latest.is_file():
        return str(run_dir / CHECKPOINTS_DIR / latest.read_text().strip())
    return "the start (no checkpoint saved yet)"
