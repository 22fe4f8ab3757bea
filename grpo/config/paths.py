"""Where configs and the repo are, and how config paths become absolute."""

from __future__ import annotations

import difflib
import os
import time
from pathlib import Path

import grpo
from grpo.config.errors import ConfigError


def repo_root() -> Path:
    """The folder holding ``grpo/``, ``configs/`` and ``recipes/``."""
    return Path(grpo.__file__).resolve().parent.parent


def configs_dir() -> Path:
    """Folder of named configs: ``$GRPO_CONFIGS_DIR`` if set, else ``<repo>/configs``."""
    return Path(os.environ.get("GRPO_CONFIGS_DIR") or repo_root() / "configs")


def list_configs() -> list[str]:
    """Names of the configs in `configs_dir`, sorted."""
    folder = configs_dir()
    return sorted(path.stem for path in folder.glob("*.yaml")) if folder.is_dir() else []


def find_config(name_or_path: str | Path) -> Path:
    """Turn a config name (``configs/NAME.yaml``) or a path into the path of an existing file.

    Args:
        name_or_path (str | Path): A name such as ``tiny_arithmetic_cpu`` or a YAML path.

    Returns:
        Path: The config file.

    Raises:
        ConfigError: If no such file exists; the message lists the available names.
    """
    text = str(name_or_path)
    available = list_configs()
    listing = ", ".join(available) or f"none in {configs_dir()}"
    looks_like_path = text.endswith((".yaml", ".yml")) or os.sep in text or "/" in text
    if looks_like_path or Path(text).is_file():
        path = Path(text).expanduser()
        if path.is_file():
            return path
        raise ConfigError(f"config file {text} not found. Named configs: {listing}")
    path = configs_dir() / f"{text}.yaml"
    if path.is_file():
        return path
    close = difflib.get_close_matches(text, available, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"unknown config {text!r}.{hint} Named configs: {listing}")


def resolve_path(path: str | Path, *, fall_back_to_repo: bool = False) -> Path:
    """Make a config path absolute.

    Args:
        path (str | Path): Absolute, or relative to the current directory.
        fall_back_to_repo (bool): If the relative path does not exist in the current directory
            but does under the repo root, use that one.

    Returns:
        Path: An absolute path (which may not exist).
    """
    path = Path(path).expanduser()
    if path.is_absolute():
        return path
    from_cwd = Path.cwd() / path
    if fall_back_to_repo and not from_cwd.exists() and (repo_root() / path).exists():
        return repo_root() / path
    return from_cwd


# --------------------------------------------------------------------------------------------
# Checkpoints in a run folder: output_dir/checkpoints/step_NNNNNN, `latest` names the newest.
# --------------------------------------------------------------------------------------------

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
STATE_FILE = "state.json"


def find_checkpoint(run_dir: Path, resume: bool | str) -> Path | None:
    """The checkpoint to resume from: ``true`` means the latest in ``run_dir``.

    Raises:
        FileNotFoundError: If ``resume`` is true and ``run_dir`` has no checkpoint.
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


# What a run leaves in its folder; a folder holding any of them holds a run.
RUN_RECORDS = ("metrics.jsonl", "trained.jsonl", "scored.jsonl", CHECKPOINTS_DIR, "final")


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
