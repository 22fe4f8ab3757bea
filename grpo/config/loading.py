"""Load a config: find its YAML, apply ``key=value`` / ``~key`` overrides, fill defaults, check.

Overrides follow torchtune: ``key.sub=value`` with values parsed as YAML; a string given to a
component node replaces its ``_component_``. ``~key`` removes a key: a key the schema knows
falls back to its default (``~eval_dataset`` turns evaluation off), a key inside a component
node to the component's own default.

Relative paths in ``base_model_path``, ``output_dir`` and ``resume_from_checkpoint`` are made
absolute when the config is loaded, because Ray actors may run in another working directory.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from grpo.config.errors import ConfigError
from grpo.config.keys import fill_defaults, may_hold_keys, schema_at, siblings_at, suggest
from grpo.config.paths import find_config, resolve_path
from grpo.config.run import RunConfig
from grpo.config.validation import validate_config

# --------------------------------------------------------------------------------------------
# Loading and overrides
# --------------------------------------------------------------------------------------------


def compose_config(name_or_path: str | Path, overrides: Sequence[str] = ()) -> DictConfig:
    """The YAML of a config with overrides applied and defaults filled in, not yet checked.

    Args:
        name_or_path (str | Path): Config name (``configs/NAME.yaml``) or path to a YAML file.
        overrides (Sequence[str]): ``key.sub=value`` (value parsed as YAML) or ``~key``.

    Returns:
        DictConfig: Interpolations unresolved, for `validate_config`.

    Raises:
        ConfigError: If the file is missing or not a YAML mapping, or overrides are malformed
            or name keys the schema does not know (all override problems are listed at once).
    """
    path = find_config(name_or_path)
    try:
        cfg = OmegaConf.load(path)
    except Exception as exc:  # yaml.YAMLError and OmegaConf's own errors
        raise ConfigError(f"{path}: not a valid YAML config: {exc}") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(f"{path}: a config must be a YAML mapping, got {type(cfg).__name__}")
    fill_defaults(cfg)
    problems: list[str] = []
    for override in overrides:
        try:
            _apply_override(cfg, override)
        except ConfigError as exc:
            problems.extend(exc.problems)
    if problems:
        raise ConfigError(problems)
    # Again: `~key` on a key the schema knows restores its default.
    fill_defaults(cfg)
    _absolutize_paths(cfg)
    return cfg


def load_config(
    name_or_path: str | Path,
    overrides: Sequence[str] = (),
    *,
    check_components: bool = False,
    import_components: bool = False,
) -> RunConfig:
    """Load a config, apply command-line overrides, check it, and return it typed.

    The config alone is checked; `grpo.preflight.load_run_config` also checks the files it
    names. Arguments as `compose_config` and `validate_config`.

    Raises:
        ConfigError: Listing every problem at once, each as ``key: what is wrong``.
    """
    return validate_config(
        compose_config(name_or_path, overrides),
        check_components=check_components,
        import_components=import_components,
    )


def _absolutize_paths(cfg: DictConfig) -> None:
    for key, fall_back in (("base_model_path", True), ("output_dir", False)):
        value = _try_get(cfg, key)
        if isinstance(value, str) and value:
            cfg[key] = str(resolve_path(value, fall_back_to_repo=fall_back))
    ref = _try_get(cfg, "ref")
    teacher = _try_get(ref, "teacher_model_path") if isinstance(ref, DictConfig) else None
    if isinstance(teacher, str) and teacher.strip():
        ref.teacher_model_path = str(resolve_path(teacher, fall_back_to_repo=True))
    resume = _try_get(cfg, "resume_from_checkpoint")
    if isinstance(resume, str) and resume:
        cfg.resume_from_checkpoint = str(resolve_path(resume))


def _try_get(cfg: DictConfig, key: str) -> Any:
    try:
        return cfg.get(key)
    except Exception:  # a broken interpolation; validate_config reports it
        return None


# `${key}` inside a YAML flow mapping or sequence: YAML reads `{` as the start of a mapping,
# so interpolations there are quoted before parsing (OmegaConf resolves them as strings).
_INTERPOLATION = re.compile(r"(?<!['\"])(\$\{[^{}]*\})")


def _parse_value(raw: str, override: str) -> Any:
    """Parse an override value as YAML, as OmegaConf does ("None" also means null).

    Raises:
        ConfigError: A value YAML cannot read, in one line with the dotted form to use.
    """
    if raw == "None":
        return None
    text = raw
    if raw.lstrip().startswith(("{", "[")):
        text = _INTERPOLATION.sub(r"'\1'", raw)
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([f"value={text}"]), resolve=False)[
            "value"
        ]
    except Exception as exc:  # yaml's and OmegaConf's parser errors
        key = override.partition("=")[0]
        reason = str(exc).strip().splitlines()[0]
        raise ConfigError(
            f"{override}: cannot parse the value as YAML ({reason}); set the keys one by one "
            f"instead, e.g. {key}._component_=pkg.Class {key}.arg=value"
        ) from None


def _split_key(key: str) -> list[str]:
    # Accept `reward_functions[0].weight` as well as `reward_functions.0.weight`.
    return [part for part in re.split(r"\.|\[(\d+)\]", key) if part]


def _walk(
    cfg: DictConfig, parts: Sequence[str], create: bool, override: str, final: str = ""
) -> Any:
    """Return the container node at `parts`, creating mappings the schema allows if `create`.

    `final` is the key the override sets below `parts`: ``_component_`` there turns a plain
    value at `parts` (``template: answer_only``) into a component node.
    """
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
            if not (create and may_hold_keys(schema_at(parts[: depth + 1]))):
                raise ConfigError(
                    f"{override}: no key {dotted} in the config"
                    f"{_unknown_hint(node, parts[: depth + 1])}"
                )
            node[part] = {}
            child = node._get_node(part)
        if not isinstance(child, (DictConfig, ListConfig)):
            last = depth == len(parts) - 1
            if (
                create
                and last
                and final == "_component_"
                and may_hold_keys(schema_at(parts[: depth + 1]))
            ):
                # `dataset.template._component_=pkg.Cls` where `template: answer_only`: the
                # value becomes a component node (its other keys follow as overrides).
                node[part] = {}
                node = node._get_node(part)
                continue
            raise ConfigError(f"{override}: {dotted} is a value, not a mapping")
        node = child
    return node


def _unknown_hint(parent: Any, parts: Sequence[str]) -> str:
    """Did-you-mean for the last of `parts`, among schema keys and keys present in `parent`."""
    siblings = siblings_at(parts[:-1])
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

    parent = _walk(cfg, parts[:-1], create=not removing, override=override, final=parts[-1])
    last = parts[-1]
    if isinstance(parent, ListConfig):
        if not last.isdigit() or int(last) >= len(parent):
            raise ConfigError(f"{override}: {key} is not an index of a {len(parent)}-list")
        if removing:
            del parent[int(last)]
        else:
            parent[int(last)] = _parse_value(raw, override)
        return

    if removing:
        if last not in parent:
            raise ConfigError(
                f"{override}: cannot remove {key}, it is not in the config"
                f"{_unknown_hint(parent, parts)}"
            )
        del parent[last]
        return

    value = _parse_value(raw, override)
    current = parent._get_node(last) if last in parent else None
    if current is None and schema_at(parts) is None:
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
