"""Find a config, load its YAML, apply ``key=value`` / ``~key`` overrides, fill defaults.

Conventions (torchtune's):

* ``grpo run async_grpo --config NAME key=value ...``: NAME is a file in the repo's
  ``configs/`` folder (``configs/NAME.yaml``) or a path to a YAML file.
* ``key.sub=value`` overrides a nested key; values are parsed as YAML (``3``, ``1e-5``,
  ``true``, ``null``, ``[1, 2]``). Overriding a component node with a string replaces its
  ``_component_`` (``dataset=grpo.data.gsm8k_dataset``).
* ``~key`` removes a key. Keys the schema knows fall back to their default (so
  ``~eval_dataset`` turns evaluation off); keys inside a component node fall back to the
  component's own default.
* ``${key}`` interpolation works as in OmegaConf (``log_dir: ${output_dir}``).

Relative paths in ``base_model_path``, ``output_dir`` and ``resume_from_checkpoint`` are made
absolute when the config is loaded, because Ray actors may run in another working directory.
They resolve against the current directory; ``base_model_path`` falls back to the repo root
when it does not exist there, so the shipped demo model is found from any directory.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

import grpo
from grpo.config.errors import ConfigError
from grpo.config.options import (
    REQUIRED,
    Component,
    ComponentList,
    Field,
    Section,
    run_schema,
)

# Schema lookups below a component or a free-form mapping: any key may exist there.
_OPEN = object()

# --------------------------------------------------------------------------------------------
# Locations
# --------------------------------------------------------------------------------------------


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
# Loading and overrides
# --------------------------------------------------------------------------------------------


def load_config(name_or_path: str | Path, overrides: Sequence[str] = ()) -> DictConfig:
    """Load a config, fill schema defaults, apply command-line overrides.

    Args:
        name_or_path (str | Path): Config name (``configs/NAME.yaml``) or path to a YAML file.
        overrides (Sequence[str]): ``key.sub=value`` (value parsed as YAML) or ``~key``.

    Returns:
        DictConfig: The config, not yet validated (see `validate_config`).

    Raises:
        ConfigError: If the file is missing or not a YAML mapping, or overrides are malformed
            or name keys the schema does not know (all override problems are listed at once).

    Example:
        >>> cfg = load_config("tiny_arithmetic_cpu", ["inference.group_size=4", "~eval_dataset"])
        >>> cfg.inference.group_size
        4
    """
    path = find_config(name_or_path)
    try:
        cfg = OmegaConf.load(path)
    except Exception as exc:  # yaml.YAMLError and OmegaConf's own errors
        raise ConfigError(f"{path}: not a valid YAML config: {exc}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: a config must be a YAML mapping, got {type(cfg).__name__}")
    fill_defaults(cfg, run_schema())
    problems: list[str] = []
    for override in overrides:
        try:
            _apply_override(cfg, override)
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems)
    # Again: `~key` on a key the schema knows restores its default.
    fill_defaults(cfg, run_schema())
    _absolutize_paths(cfg)
    return cfg


def fill_defaults(node: DictConfig, section: Section) -> None:
    """Set absent keys to their schema default; component nodes are never merged into."""
    for key, spec in section.fields.items():
        if isinstance(spec, Section):
            child = node._get_node(key) if key in node else None
            if child is None or child._is_none():  # absent, or an empty `inference:` line
                node[key] = {}
                child = node._get_node(key)
            if isinstance(child, DictConfig):
                fill_defaults(child, spec)
        elif key not in node and spec.default is not REQUIRED:
            node[key] = spec.default


def _absolutize_paths(cfg: DictConfig) -> None:
    for key, fall_back in (("base_model_path", True), ("output_dir", False)):
        value = _try_get(cfg, key)
        if isinstance(value, str) and value:
            cfg[key] = str(resolve_path(value, fall_back_to_repo=fall_back))
    resume = _try_get(cfg, "resume_from_checkpoint")
    if isinstance(resume, str) and resume:
        cfg.resume_from_checkpoint = str(resolve_path(resume))


def _try_get(cfg: DictConfig, key: str) -> Any:
    try:
        return cfg.get(key)
    except Exception:  # a broken interpolation; validate_config reports it
        return None


def _parse_value(raw: str) -> Any:
    """Parse an override value the way OmegaConf parses YAML values ("None" also means null)."""
    if raw == "None":
        return None
    return OmegaConf.to_container(OmegaConf.from_dotlist([f"value={raw}"]), resolve=False)["value"]


def _split_key(key: str) -> list[str]:
    # Accept `reward_functions[0].weight` as well as `reward_functions.0.weight`.
    return [part for part in re.split(r"\.|\[(\d+)\]", key) if part]


def _schema_at(parts: Sequence[str]) -> Any:
    """Schema entry of a dotted key: a spec, `_OPEN` (inside a free-form node), or None."""
    spec: Any = run_schema()
    for part in parts:
        if isinstance(spec, Section):
            spec = spec.fields.get(part)
            if spec is None:
                return None
        elif isinstance(spec, (Component, ComponentList)) or (
            isinstance(spec, Field) and dict in spec.types
        ):
            return _OPEN
        else:  # below a scalar, or unknown
            return _OPEN if spec is _OPEN else None
    return spec


def _all_schema_keys(section: Section | None = None, prefix: str = "") -> list[str]:
    section = section or run_schema()
    keys = []
    for key, spec in section.fields.items():
        keys.append(prefix + key)
        if isinstance(spec, Section):
            keys.extend(_all_schema_keys(spec, f"{prefix}{key}."))
    return keys


def suggest(prefix: str, key: str, siblings: Sequence[str]) -> str:
    """A ``; did you mean ...?`` hint for an unknown key, or an empty string."""
    from grpo.config.run import REMOVED_KEYS  # imports the component modules: not at import

    if not prefix and key in REMOVED_KEYS:
        return f"; {key} is no longer used: {REMOVED_KEYS[key]}"
    close = difflib.get_close_matches(key, list(siblings), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {prefix}{close[0]}?"
    elsewhere = [full for full in _all_schema_keys() if full.rsplit(".", 1)[-1] == key]
    if elsewhere:
        return f"; did you mean {' or '.join(elsewhere)}?"
    return ""


def _schema_siblings(parts: Sequence[str]) -> list[str]:
    spec = _schema_at(parts) if parts else run_schema()
    return list(spec.fields) if isinstance(spec, Section) else []


def _walk(cfg: DictConfig, parts: Sequence[str], create: bool, override: str) -> Any:
    """Return the container node at `parts`, creating mappings the schema allows if `create`."""
    node: Any = cfg
    for depth, part in enumerate(parts):
        dotted = ".".join(parts[: depth + 1])
        if isinstance(node, ListConfig):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"{override}: {dotted} is not an index of a {len(node)}-list")
            node = node._get_node(int(part))
            continue
        child = node._get_node(part) if part in node else None
        if child is None or child._is_none():
            known = _schema_at(parts[: depth + 1])
            may_create = (
                known is _OPEN
                or isinstance(known, (Section, Component))
                or (isinstance(known, Field) and dict in known.types)
            )
            if not (create and may_create):
                raise ConfigError(
                    f"{override}: no key {dotted} in the config"
                    f"{_unknown_hint(node, parts[: depth + 1])}"
                )
            node[part] = {}
            child = node._get_node(part)
        if not isinstance(child, (DictConfig, ListConfig)):
            raise ConfigError(f"{override}: {dotted} is a value, not a mapping")
        node = child
    return node


def _unknown_hint(parent: Any, parts: Sequence[str]) -> str:
    """Did-you-mean for the last of `parts`, among schema keys and keys present in `parent`."""
    siblings = _schema_siblings(parts[:-1])
    if isinstance(parent, DictConfig):
        siblings += [str(key) for key in parent.keys()]
    prefix = ".".join(parts[:-1]) + "." if len(parts) > 1 else ""
    return suggest(prefix, parts[-1], siblings)


def _apply_override(cfg: DictConfig, override: str) -> None:
    removing = override.startswith("~")
    key, sep, raw = (override[1:] if removing else override).partition("=")
    parts = _split_key(key)
    if removing and (sep or not parts):
        raise ConfigError(f"{override!r}: expected ~key, e.g. ~eval_dataset")
    if not removing and (not sep or not parts):
        raise ConfigError(f"{override!r}: overrides are key=value or ~key")

    parent = _walk(cfg, parts[:-1], create=not removing, override=override)
    last = parts[-1]
    if isinstance(parent, ListConfig):
        if not last.isdigit() or int(last) >= len(parent):
            raise ConfigError(f"{override}: {key} is not an index of a {len(parent)}-list")
        if removing:
            del parent[int(last)]
        else:
            parent[int(last)] = _parse_value(raw)
        return

    if removing:
        if last not in parent:
            raise ConfigError(
                f"{override}: cannot remove {key}, it is not in the config"
                f"{_unknown_hint(parent, parts)}"
            )
        del parent[last]
        return

    value = _parse_value(raw)
    current = parent._get_node(last) if last in parent else None
    if current is None and _schema_at(parts) is None:
        raise ConfigError(f"{override}: unknown key {key}{_unknown_hint(parent, parts)}")
    if (
        isinstance(current, DictConfig)
        and not current._is_none()
        and "_component_" in current
        and isinstance(value, str)
    ):
        # torchtune's shorthand: `dataset=pkg.fn` swaps the component, keeping its kwargs.
        current["_component_"] = value
    else:
        parent[last] = value
