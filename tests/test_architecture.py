"""The rooms of the package: which parts of grpo/ may import which, read from the source.

A component imports its config, never the reverse; the packages of grpo/ import each other
without a cycle; the compute modules import torch, never Ray or vLLM.
"""

from __future__ import annotations

import ast
import functools
from collections import defaultdict
from pathlib import Path

GRPO = Path(__file__).resolve().parents[1] / "grpo"
COMPUTE_MODULES = ("types.py", "packing", "objective")


def _part(module: str) -> str | None:
    """The part of grpo/ a module belongs to: its subpackage, or its top-level module."""
    parts = module.split(".")
    if parts[0] != "grpo" or len(parts) == 1:
        return None
    return parts[1]


def _imports(path: Path) -> list[str]:
    """Absolute module names a file imports, at any depth (lazy imports count too)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return names


@functools.cache
def part_graph() -> dict[str, dict[str, list[str]]]:
    """part -> imported part -> the files that import it."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(GRPO.rglob("*.py")):
        source = path.relative_to(GRPO).parts[0].removesuffix(".py")
        for module in _imports(path):
            target = _part(module)
            if target and target != source:
                graph[source][target].append(str(path.relative_to(GRPO.parent)))
    return graph


def test_the_parts_of_grpo_import_each_other_without_a_cycle():
    graph = part_graph()
    state: dict[str, str] = {}
    cycles = []

    def visit(part: str, trail: list[str]) -> None:
        state[part] = "open"
        for target in graph.get(part, {}):
            if state.get(target) == "open":
                cycles.append(trail[trail.index(target) :] + [target])
            elif target not in state:
                visit(target, trail + [target])
        state[part] = "done"

    for part in list(graph):
        if part not in state:
            visit(part, [part])
    assert not cycles, cycles


def test_config_imports_no_component():
    # The choices are plain Literals; the dataset file checks live beside the loaders and the
    # environment's tool checks beside the tools; they import neither torch nor the hub.
    allowed = {"choices", "data", "envs"}
    imported = set(part_graph().get("config", {}))
    assert imported <= allowed, {part: part_graph()["config"][part] for part in imported - allowed}


def test_compute_modules_import_no_ray_or_vllm():
    for name in COMPUTE_MODULES:
        paths = [GRPO / name] if name.endswith(".py") else sorted((GRPO / name).rglob("*.py"))
        assert paths, name
        for path in paths:
            roots = {module.split(".")[0] for module in _imports(path)}
            assert not roots & {"ray", "vllm"}, path
