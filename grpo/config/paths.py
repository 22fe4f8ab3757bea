"""Where configs and the repo are, and how config paths become absolute.

The layout of a run folder (checkpoints, what marks a run) is `grpo.run_folder`'s.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from grpo.config.errors import ConfigError


def repo_root() -> Path:
    """The folder holding ``grpo/``, ``configs/`` and ``recipes/``."""
    return Path(__file__).resolve().parents[2]


def configs_dir() -> Path:
    """Folder of named configs: ``$GRPO_CONFIGS_DIR`` if set, else ``<repo>/configs``."""
    return Path(os.environ.get("GRPO_CONFIGS_DIR") or repo_root() / "configs")


def list_configs() -> list[str]:
    """Names of the configs in `configs_dir`, sorted."""
    folder = configs_dir()
    return sorted(path.stem for path in folder.glob("*.yaml")) if folder.is_dir() else []


def find_config(name_or_path: str | Path) -> Path:
    """Turn a config name (``configs/NAME.yaml``) or a path into the path of an existing file.

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
    """Make a config path absolute (it may not exist), relative to the current directory.

    With ``fall_back_to_repo``, a relative path missing there but present under the repo root
    resolves there.
    """
    path = Path(path).expanduser()
    if path.is_absolute():
        return path
    from_cwd = Path.cwd() / path
    if fall_back_to_repo and not from_cwd.exists() and (repo_root() / path).exists():
        return repo_root() / path
    return from_cwd
