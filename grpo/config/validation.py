"""Check a config and report every problem at once, each as ``key: what is wrong``.

These checks read the config alone; what it names on disk is checked above it, by
`grpo.preflight`, which adds its problems to those of `check_config`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from pydantic import BaseModel, ValidationError

from grpo.config.errors import ConfigError, InstantiationError
from grpo.config.instantiate import keyword_names, locate
from grpo.config.keys import fill_defaults, siblings_at, suggest
from grpo.config.reward_forms import function_parameters, is_reward_node_key, reward_node_check
from grpo.config.run import UNRESOLVED, RunConfig
from grpo.config.schema import (
    ComponentSpec,
    Section,
    component_spec,
    optional_section_type,
    section_type,
)
from grpo.config.signatures import static_function, static_keyword_names

_TYPE_NAMES = {
    "int": "int",
    "float": "number",
    "bool": "bool",
    "str": "string",
    "dict": "mapping",
    "list": "list",
    "none": "null",
}

# Even when checking by import, the components of the libraries only the trainer uses are read
# from source (`grpo.config.signatures`) unless it cannot tell: importing torchtune (and with it
# torchao, datasets and pandas) would cost the driver seconds before its actors start.
_READ_FROM_SOURCE = ("torchtune.", "torchao.")


@dataclass(frozen=True)
class CheckedConfig:
    """What `check_config` found.

    Attributes:
        values (dict[str, Any]): The config as plain values with the declared defaults,
            interpolations resolved (a failed one is `UNRESOLVED`, and reported).
        run (RunConfig | None): The typed config; None when a key failed its section's checks.
        problems (list[str]): Every problem, each as ``key: what is wrong``.
    """

    values: dict[str, Any]
    run: RunConfig | None
    problems: list[str]


def check_config(
    cfg: DictConfig | Mapping[str, Any],
    *,
    check_components: bool = True,
    import_components: bool = True,
    importer: Callable[[str], Any] = locate,
) -> CheckedConfig:
    """Check a config and return every problem, without raising.

    Nothing is instantiated, no file the config names is read, and the machine is not asked
    its size.

    Args:
        check_components (bool): Check that every ``_component_`` exists and takes the keyword
            arguments its node gives.
        import_components (bool): Check by importing the components (exact; loads torch and
            the like); False reads their source instead (`grpo.config.signatures`: fast, and
            skips what the source does not tell).
        importer (Callable[[str], Any]): Imports a dotted path when ``import_components``;
            `locate` unless the caller must prepare some imports first.

    Raises:
        ConfigError: Only if `cfg` is not a mapping at all.
    """
    problems: list[str] = []
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=False)
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"a config must be a mapping, got {type(cfg).__name__}")
    # A copy with the declared defaults, as `compose_config` gives it; the caller's is untouched.
    node = OmegaConf.create(dict(cfg))
    fill_defaults(node)
    unresolved: list[str] = []
    values = _resolve_all(node, "", problems, unresolved)

    run = None
    try:
        run = RunConfig.model_validate(values)
    except ValidationError as exc:
        problems.extend(pydantic_problems(exc, RunConfig, skip=unresolved))
    mode = ("import" if import_components else "source") if check_components else None
    problems.extend(_component_problems(values, mode, importer))
    problems.extend(RunConfig.relation_problems(values))
    return CheckedConfig(values, run, problems)


def validate_config(
    cfg: DictConfig | Mapping[str, Any],
    *,
    check_components: bool = True,
    import_components: bool = True,
) -> RunConfig:
    """Check a config and return it typed; report every problem at once.

    The checks of `check_config`, whose arguments it takes.

    Returns:
        RunConfig: The typed config, interpolations resolved.

    Raises:
        ConfigError: Listing every problem, each as ``key: what is wrong``.
    """
    checked = check_config(
        cfg, check_components=check_components, import_components=import_components
    )
    if checked.problems:
        raise ConfigError(checked.problems)
    assert checked.run is not None
    return checked.run


def pydantic_problems(
    error: ValidationError, model: type[BaseModel], prefix: str = "", skip: list[str] = ()
) -> list[str]:
    """Turn pydantic's errors into ``key: what is wrong`` lines, one per key.

    Args:
        model (type[BaseModel]): The model validated (to tell keys from union member tags).
        prefix (str): Dotted path of the model in the whole config, with a trailing dot.
        skip (list[str]): Keys whose value is already reported (failed interpolations).
    """
    by_path: dict[str, list[tuple[dict, str | None]]] = {}
    for item in error.errors(include_url=False):
        path, member = _path_of(item["loc"], model, prefix)
        if any(path == key or path.startswith(f"{key}.") for key in skip):
            continue
        by_path.setdefault(path, []).append((item, member))
    problems = []
    for path, items in by_path.items():
        members = [member for _, member in items if member]
        if len(members) > 1:  # every member of a union refused the value
            names = " or ".join(_TYPE_NAMES.get(member, member) for member in members)
            problems.append(f"{path}: expected {names}, got {items[0][0]['input']!r}")
        else:
            problems.append(f"{path}: {_message(items[0][0], path)}")
    return problems


def _path_of(loc: tuple, model: type[BaseModel], prefix: str) -> tuple[str, str | None]:
    """Dotted path of an error location, and the union member it names, if any."""
    path, member = prefix.rstrip("."), None
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(current, type) and issubclass(current, BaseModel):
            path = f"{path}.{part}" if path else str(part)
            info = current.model_fields.get(part)
            # An optional section (``training.lora``) is still a section below it.
            current = optional_section_type(info) if info is not None else None
        else:  # below a plain field: a union member's tag (`bool`, `str`)
            member = str(part)
    return path, member


def _message(item: dict, path: str) -> str:
    kind, value, ctx = item["type"], item.get("input"), item.get("ctx") or {}
    if kind == "missing":
        return "required key is missing"
    if kind == "extra_forbidden":
        prefix, _, key = path.rpartition(".")
        parts = prefix.split(".") if prefix else []
        return "unknown key" + suggest(f"{prefix}." if prefix else "", key, siblings_at(parts))
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"must be one of {', '.join(choices)}; got {value!r}{hint}"
    for bound, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if bound in ctx and kind.startswith(("greater", "less")):
            limit = ctx[bound]
            if isinstance(limit, float) and limit.is_integer():
                limit = int(limit)
            return f"must be {sign} {limit}, got {value!r}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"expected a mapping, got {value!r}"
    if kind.endswith(("_type", "_parsing")) and kind.split("_")[0] in _TYPE_NAMES:
        return f"expected {_TYPE_NAMES[kind.split('_')[0]]}, got {value!r}"
    if kind == "value_error":
        return str(ctx.get("error", item["msg"]))
    return item["msg"]


def _resolve_all(node: Any, path: str, problems: list[str], unresolved: list[str]) -> Any:
    """Plain Python copy of `node` with interpolations resolved; failures become UNRESOLVED."""
    if isinstance(node, (DictConfig, ListConfig)) and node._is_none():
        return None
    if isinstance(node, DictConfig):
        items = [(key, f"{path}.{key}" if path else str(key)) for key in node.keys()]
    elif isinstance(node, ListConfig):
        items = [(index, f"{path}[{index}]") for index in range(len(node))]
    else:
        return node
    out: dict | list = {} if isinstance(node, DictConfig) else []
    for key, full in items:
        try:
            child = _resolve_all(node[key], full, problems, unresolved)
        except Exception as exc:  # interpolation or missing-value errors of OmegaConf
            problems.append(f"{full}: {str(exc).splitlines()[0]}")
            unresolved.append(full)
            child = UNRESOLVED
        if isinstance(out, dict):
            out[key] = child
        else:
            out.append(child)
    return out


def _component_nodes(values: dict, model: type[Section], prefix: str = ""):
    """(path, node, spec) of every component node the config sets, sections included."""
    for key, info in model.model_fields.items():
        value = values.get(key) if isinstance(values, dict) else None
        nested = section_type(info)
        if nested is not None:
            yield from _component_nodes(value or {}, nested, f"{prefix}{key}.")
            continue
        spec = component_spec(info)
        if spec is None or value is None or value is UNRESOLVED:
            continue
        if spec.many:
            for index, item in enumerate(value if isinstance(value, list) else []):
                yield f"{prefix}{key}[{index}]", item, ComponentSpec()
        else:
            yield f"{prefix}{key}", value, spec


def _component_problems(
    values: dict, mode: str | None, importer: Callable[[str], Any]
) -> list[str]:
    problems: list[str] = []
    for path, node, spec in _component_nodes(values, RunConfig):
        if not isinstance(node, dict) or not isinstance(node.get("_component_"), str):
            continue  # reported by the section checks
        if spec.args is not None:
            documented = {
                key: node[key]
                for key in spec.args.model_fields
                if key in node and node[key] is not UNRESOLVED
            }
            try:
                spec.args.model_validate(documented)
            except ValidationError as exc:
                problems.extend(pydantic_problems(exc, spec.args, prefix=f"{path}."))
        _check_component(path, node, problems, mode, importer)
    return problems


def _reward_keywords(
    target: str, node: dict, mode: str, importer: Callable[[str], Any]
) -> tuple[str | None, set[str] | None]:
    """A reward function node's problem, if any, and the keys it may set, by the rule the run
    builds it with (`grpo.config.reward_forms`): imported, or read from source."""
    keys = [key for key in node if key != "_component_"]
    if mode == "import":
        component = importer(target)
        parameters = function_parameters(component)
        if parameters is None:
            return None, keyword_names(component)
        return reward_node_check(target, parameters, False, keys)
    function = static_function(target)
    if function is None:
        return None, static_keyword_names(target)
    return reward_node_check(target, *function, keys)


def _check_component(
    path: str,
    node: Any,
    problems: list[str],
    mode: str | None,
    importer: Callable[[str], Any],
) -> None:
    """Check a node's path and keywords: by importing it with `importer` (`mode` "import"),
    from its source ("source"), or only its shape (None)."""
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
    if mode is not None:
        problem = None
        try:
            if is_reward_node_key(path):
                problem, accepted = _reward_keywords(target, node, mode, importer)
            elif mode == "import" and not target.startswith(_READ_FROM_SOURCE):
                accepted = keyword_names(importer(target))
            else:
                accepted = static_keyword_names(target)
                if accepted is None and mode == "import":
                    accepted = keyword_names(importer(target))
        except InstantiationError as exc:
            problems.append(f"{path}._component_: {exc}")
        else:
            if problem is not None:
                problems.append(f"{path}: {problem}")
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
                _check_component(f"{path}.{key}{suffix}", item, problems, mode, importer)
