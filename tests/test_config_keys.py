"""Every key of every shipped config is read by something.

A key that nothing reads looks like a setting but changes nothing, and no check can tell the
user. For each key of each ``configs/*.yaml``:

* an option of a typed section (or of `RunConfig`) must be read somewhere in ``grpo/`` or
  ``recipes/`` outside ``grpo/config/`` (which only declares, loads and checks options): as an
  attribute that is not called (``config.mask_kind``; ``re.compile(...)`` is no read of a
  ``compile`` option), or as a string key (``cfg["seed"]``, ``cfg.get("seed")``,
  ``getattr(cfg, "seed")``). The scan is by name, so it cannot tell two options of one name
  apart; it does catch an option that no code mentions at all.
* a keyword of a ``_component_`` node must be one its target accepts (signature check), and
  nested component nodes are checked the same way.
* a key of ``inference.engine_args`` must be a ``vllm.EngineArgs`` field (``vllm.LLM`` passes
  its keyword arguments on to it).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from grpo.config import Component, ComponentList, Field, Section, locate, repo_root, run_schema
from grpo.config.instantiate import keyword_names

CONFIGS = sorted((repo_root() / "configs").glob("*.yaml"))
SOURCE_DIRS = ("grpo", "recipes")
# Declares, loads and checks options: a name mentioned only here is read by no component.
NOT_A_READER = Path("grpo") / "config"
# Dict-valued options whose keys are keyword arguments of a library class.
PASSED_THROUGH = {"inference.engine_args": "vllm.engine.arg_utils.EngineArgs"}
# Method calls that read a mapping by key: cfg.get("seed"), node.pop("_component_").
KEY_READERS = {"get", "pop", "setdefault"}


def _names_read_in(tree: ast.AST) -> Iterator[str]:
    callees = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            if id(node) not in callees:  # `x.compile(...)` calls a method, reads no option
                yield node.attr
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            yield str(node.slice.value)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[-1], ast.Constant):
            func = node.func
            is_getattr = isinstance(func, ast.Name) and func.id == "getattr"
            is_key_read = isinstance(func, ast.Attribute) and func.attr in KEY_READERS
            if is_getattr and len(node.args) >= 2:
                yield str(node.args[1].value)
            elif is_key_read:
                yield str(node.args[0].value) if isinstance(node.args[0], ast.Constant) else ""


@functools.cache
def names_read() -> frozenset[str]:
    """Every name the code of ``grpo/`` (minus ``grpo/config/``) and ``recipes/`` reads."""
    root = repo_root()
    names: set[str] = set()
    for folder in SOURCE_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            if path.relative_to(root).is_relative_to(NOT_A_READER):
                continue
            names.update(_names_read_in(ast.parse(path.read_text(), filename=str(path))))
    return frozenset(names)


def _keyword_problems(path: str, node: dict[str, Any]) -> Iterator[str]:
    """Keys of a ``_component_`` node its target does not take, nested nodes included."""
    target = locate(node["_component_"])
    accepted = keyword_names(target)
    for key, value in node.items():
        if key == "_component_":
            continue
        if accepted is not None and key not in accepted:
            yield f"{path}.{key}: {node['_component_']} takes no keyword {key!r}"
        items = value if isinstance(value, list) else [value]
        for index, item in enumerate(items):
            if isinstance(item, dict) and "_component_" in item:
                suffix = f"[{index}]" if isinstance(value, list) else ""
                yield from _keyword_problems(f"{path}.{key}{suffix}", item)


def _unread_keys(values: dict[str, Any], section: Section, prefix: str = "") -> Iterator[str]:
    """Keys of `values` (a config mapping laid out like `section`) that nothing reads."""
    for key, value in values.items():
        path = prefix + key
        spec = section.fields.get(key)
        if spec is None:
            yield f"{path}: not an option of the schema"
            continue
        if key not in names_read():
            yield f"{path}: the option {key!r} is read nowhere in grpo/ or recipes/"
        if isinstance(spec, Section) and isinstance(value, dict):
            yield from _unread_keys(value, spec, f"{path}.")
        elif isinstance(spec, Component) and isinstance(value, dict):
            yield from _keyword_problems(path, value)
        elif isinstance(spec, ComponentList) and isinstance(value, list):
            for index, item in enumerate(value):
                yield from _keyword_problems(f"{path}[{index}]", item)
        elif isinstance(spec, Field) and path in PASSED_THROUGH and isinstance(value, dict):
            accepted = {field.name for field in dataclasses.fields(locate(PASSED_THROUGH[path]))}
            for name in value:
                if name not in accepted:
                    yield f"{path}.{name}: not a keyword of {PASSED_THROUGH[path]}"


def test_every_shipped_config_is_walked():
    assert len(CONFIGS) >= 4
    assert {"tiny_arithmetic_cpu.yaml", "qwen2_5_0_5b_gsm8k.yaml"} <= {p.name for p in CONFIGS}


@pytest.mark.parametrize("config_path", CONFIGS, ids=lambda path: path.stem)
def test_every_key_of_a_shipped_config_is_read(config_path):
    values = OmegaConf.to_container(OmegaConf.load(config_path), resolve=False)
    problems = list(_unread_keys(values, run_schema()))
    assert not problems, f"{config_path.name}:\n" + "\n".join(problems)


def test_the_scan_finds_reads_and_ignores_calls_and_declarations():
    source = """
@dataclass
class Options:
    unread_option: int = option(1, "declared, never read")

def use(config, cfg):
    pattern = re.compile("x")
    return config.mask_kind, cfg["seed"], cfg.get("eval_dataset"), getattr(cfg, "top_p")
"""
    names = set(_names_read_in(ast.parse(source)))
    assert {"mask_kind", "seed", "eval_dataset", "top_p"} <= names
    assert "compile" not in names and "unread_option" not in names
    # A config key read by nothing is reported with its path.
    section = Section("s", {"unread_option": Field((int,), "")})
    assert [p.split(":")[0] for p in _unread_keys({"unread_option": 1}, section)] == [
        "unread_option"
    ]
