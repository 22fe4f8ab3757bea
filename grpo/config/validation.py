"""Check a config against the declared options and report every problem at once."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from grpo.config.errors import ConfigError, InstantiationError
from grpo.config.instantiate import keyword_names, locate
from grpo.config.loading import fill_defaults, suggest
from grpo.config.options import (
    REQUIRED,
    UNRESOLVED,
    Component,
    ComponentList,
    Field,
    Section,
    field_problem,
    run_schema,
)


def validate_config(
    cfg: DictConfig | Mapping[str, Any],
    *,
    check_files: bool = True,
    check_components: bool = True,
) -> None:
    """Check a config against the schema and report every problem at once.

    Checks unknown keys (with did-you-mean), types, value ranges and enums, relations between
    keys (token budget, divisibility, buffer size, Ray resources), the model folder, and that
    every ``_component_`` imports and accepts its keyword arguments. Nothing is instantiated.

    Args:
        cfg (DictConfig | Mapping[str, Any]): The config, e.g. from `load_config`.
        check_files (bool): Check the model folder and the resume checkpoint exist.
        check_components (bool): Import every ``_component_`` and check its keyword arguments.

    Raises:
        ConfigError: Listing every problem, each as ``key: what is wrong``.

    Example:
        >>> validate_config(load_config("tiny_arithmetic_cpu"))
    """
    problems: list[str] = []
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=False)
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"a config must be a mapping, got {type(cfg).__name__}")
    # A copy with the schema defaults, as `load_config` would give it; the caller's is untouched.
    cfg = OmegaConf.create(dict(cfg))
    schema = run_schema()
    fill_defaults(cfg, schema)
    values = _resolve_all(cfg, "", problems)
    # Imported here for the same reason as in `run_schema`.
    from grpo.config.run import REMOVED_KEYS, RunConfig

    for key, instead in REMOVED_KEYS.items():
        if key in values:  # more useful than "unknown key" for a key that used to exist
            problems.append(f"{key}: no longer used; {instead}")
            del values[key]
    _check_section(schema, values, "", problems, check_components)
    problems.extend(RunConfig.relation_problems(values, check_files))
    if problems:
        raise ConfigError(problems)


def _resolve_all(node: Any, path: str, problems: list[str]) -> Any:
    """Plain Python copy of `node` with interpolations resolved; failures become UNRESOLVED."""
    if isinstance(node, DictConfig):
        if node._is_none():
            return None
        out = {}
        for key in node.keys():
            full = f"{path}.{key}" if path else str(key)
            try:
                child = node[key]
            except Exception as exc:  # interpolation or missing-value errors of OmegaConf
                problems.append(f"{full}: {str(exc).splitlines()[0]}")
                out[key] = UNRESOLVED
                continue
            out[key] = _resolve_all(child, full, problems)
        return out
    if isinstance(node, ListConfig):
        if node._is_none():
            return None
        out_list = []
        for index in range(len(node)):
            full = f"{path}[{index}]"
            try:
                child = node[index]
            except Exception as exc:
                problems.append(f"{full}: {str(exc).splitlines()[0]}")
                out_list.append(UNRESOLVED)
                continue
            out_list.append(_resolve_all(child, full, problems))
        return out_list
    return node


def _check_field(path: str, spec: Field, value: Any, problems: list[str]) -> None:
    if value is UNRESOLVED:
        return
    problem = field_problem(spec, value)
    if problem:
        problems.append(f"{path}: {problem}")


def _check_section(
    section: Section, values: dict, prefix: str, problems: list[str], check_components: bool
) -> None:
    for key in values:
        if key not in section.fields:
            hint = suggest(prefix, str(key), list(section.fields))
            problems.append(f"{prefix}{key}: unknown key{hint}")
    for key, spec in section.fields.items():
        path = prefix + key
        if key not in values:
            if not isinstance(spec, Section) and spec.default is REQUIRED:
                problems.append(f"{path}: required key is missing")
            elif isinstance(spec, Section):
                _check_section(spec, {}, f"{path}.", problems, check_components)
            continue
        value = values[key]
        if value is UNRESOLVED:
            continue
        if isinstance(spec, Section):
            if not isinstance(value, dict):
                problems.append(f"{path}: expected a mapping, got {value!r}")
            else:
                _check_section(spec, value, f"{path}.", problems, check_components)
        elif isinstance(spec, Field):
            _check_field(path, spec, value, problems)
        elif isinstance(spec, Component):
            if value is None:
                if spec.default is REQUIRED:
                    problems.append(f"{path}: required component is null")
            else:
                _check_component(path, value, spec.kwargs, problems, check_components)
        elif isinstance(spec, ComponentList):
            if not isinstance(value, list) or not value:
                problems.append(f"{path}: expected a non-empty list of _component_ nodes")
            else:
                for index, item in enumerate(value):
                    _check_component(f"{path}[{index}]", item, {}, problems, check_components)


def _check_component(
    path: str,
    node: Any,
    kwarg_specs: Mapping[str, Field],
    problems: list[str],
    check_components: bool,
) -> None:
    if node is UNRESOLVED:
        return
    if not isinstance(node, dict) or "_component_" not in node:
        problems.append(
            f"{path}: expected a mapping with a _component_ key (a dotted import path), "
            f"got {node!r}"
        )
        return
    target = node["_component_"]
    if not isinstance(target, str) or not target:
        problems.append(f"{path}._component_: expected a dotted import path, got {target!r}")
        return
    for key, spec in kwarg_specs.items():
        if key in node:
            _check_field(f"{path}.{key}", spec, node[key], problems)
    if check_components:
        try:
            component = locate(target)
        except InstantiationError as exc:
            problems.append(f"{path}._component_: {exc}")
        else:
            accepted = keyword_names(component)
            if accepted is not None:
                for key in node:
                    if key != "_component_" and key not in accepted:
                        close = difflib.get_close_matches(str(key), sorted(accepted), n=1)
                        hint = f"; did you mean {close[0]}?" if close else ""
                        problems.append(f"{path}.{key}: {target} takes no argument {key!r}{hint}")
    # Nested components (e.g. a dataset's prompt template) are built by `instantiate` too.
    for key, value in node.items():
        items = value if isinstance(value, list) else [value]
        for index, item in enumerate(items):
            if isinstance(item, dict) and "_component_" in item:
                suffix = f"[{index}]" if isinstance(value, list) else ""
                _check_component(f"{path}.{key}{suffix}", item, {}, problems, check_components)
