"""The rooms of the package: which parts of grpo/ may import which, read from the source.

A component imports its config, never the reverse; the packages of grpo/ import each other
without a cycle; the compute modules import torch, never Ray or vLLM.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

GRPO = Path(__file__).resolve().parents[2] / "grpo"
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


def _imported_by_name(path: Path) -> list[str]:
    """Module names a file imports by string: ``importlib.import_module("...")``,
    ``__import__("...")``."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        first = node.args[0]
        if name in ("import_module", "__import__") and isinstance(first, ast.Constant):
            if isinstance(first.value, str):
                names.append(first.value)
    return names


def test_config_imports_no_component():
    # A config is a schema: the components import it, and what it names on disk is checked
    # above it (grpo.preflight). The choices are plain Literals that both sides share.
    allowed = {"choices"}
    imported = set(part_graph().get("config", {}))
    assert imported <= allowed, {part: part_graph()["config"][part] for part in imported - allowed}
    for path in sorted((GRPO / "config").rglob("*.py")):
        for module in _imports(path) + _imported_by_name(path):
            own = module == "grpo" or module.startswith("grpo.")
            assert not own or _part(module) in allowed | {"config"}, (str(path), module)


def test_compute_modules_import_no_ray_or_vllm():
    for name in COMPUTE_MODULES:
        paths = [GRPO / name] if name.endswith(".py") else sorted((GRPO / name).rglob("*.py"))
        assert paths, name
        for path in paths:
            roots = {module.split(".")[0] for module in _imports(path)}
            assert not roots & {"ray", "vllm"}, path


def _names_used(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names |= {alias.name for alias in node.names}
    return names


def _environment_classes() -> set[str]:
    """Every class of grpo/envs that is an environment (subclasses of the protocol's base)."""
    import grpo.envs as envs
    from grpo.envs.protocol import Environment

    return {
        name
        for name in dir(envs)
        if isinstance(getattr(envs, name), type)
        and issubclass(getattr(envs, name), Environment)
        and getattr(envs, name) is not Environment
    }


def test_one_environment_protocol_and_the_collector_names_no_environment_kind():
    kinds = _environment_classes()
    assert {"SingleTurnEnv", "MultiTurnEnv", "ToolEnv", "VerifiersEnv"} <= kinds
    for path in (GRPO / "workers" / "collector.py", GRPO.parent / "recipes" / "async_grpo.py"):
        used = _names_used(path)
        assert not used & kinds, (path.name, used & kinds)
        # Asked of the protocol, never probed: no environment attribute read by getattr.
        source = path.read_text()
        assert "supplies_tasks" not in source and "_plays_own_episodes" not in source
        assert "getattr(self.environment" not in source and "getattr(environment" not in source


@pytest.mark.parametrize("package", ["grpo.config", "grpo.envs", "grpo.data"])
def test_reading_configs_and_environments_loads_no_torch(package):
    """``grpo validate`` imports these to check a config, its datasets' options, its tools and
    its environment: a torch import there costs every validation seconds (a hub environment's
    scorer is a reward function, imported only when the environment is built)."""
    code = f"import sys, {package}; print(sorted(m for m in ('torch', 'ray', 'vllm') if m in sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout


def test_reward_and_tool_workers_load_no_torch():
    """A run starts two forkservers (the collector's and the reference actor's), each importing
    what every reward and tool worker shares; torch there would cost each of them seconds, and
    workers that call a reward or a tool never use it. The test suite's own tools and rewards
    run in such workers too."""
    from grpo.process_pool import FORKSERVER_PRELOAD

    modules = [*FORKSERVER_PRELOAD, "grpo.envs", "grpo.testing.tools", "grpo.testing.rewards"]
    code = (
        f"import sys, {', '.join(modules)}; "
        "print(sorted(m for m in ('torch', 'ray', 'vllm') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]", result.stdout


def test_no_module_of_the_config_package_imports_torch_ray_or_vllm_anywhere():
    """Not even inside a function: a check that needs torch (the machine's GPUs) belongs to
    `grpo.preflight`, above the config."""
    heavy = {"torch", "ray", "vllm"}
    for path in sorted((GRPO / "config").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            assert not {name.split(".")[0] for name in names} & heavy, (path.name, names)
