"""The largest classes of some packages: methods and attributes per class, largest first.

    python scripts/code_stats.py grpo/orchestrator recipes
    python scripts/code_stats.py grpo --top 20

Methods are the ``def``s in the class body (properties included); attributes are the names
assigned to ``self.<name>`` anywhere in it, plus class-level assignments (``x = property(...)``).
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def class_sizes(paths: list[str]) -> list[tuple[int, int, str]]:
    """``(methods, attributes, "file:Class")`` for every class in the ``.py`` files under ``paths``."""
    rows = []
    for root in paths:
        files = [Path(root)] if root.endswith(".py") else sorted(Path(root).rglob("*.py"))
        for path in files:
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ClassDef):
                    continue
                methods = [
                    n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                ]
                attributes = {
                    target.attr
                    for n in ast.walk(node)
                    if isinstance(n, ast.Assign | ast.AnnAssign | ast.AugAssign)
                    for target in (n.targets if isinstance(n, ast.Assign) else [n.target])
                    for target in ast.walk(target)
                    if isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                }
                for n in node.body:
                    if isinstance(n, ast.Assign):
                        attributes.update(t.id for t in n.targets if isinstance(t, ast.Name))
                rows.append((len(methods), len(attributes), f"{path}:{node.name}"))
    return sorted(rows, reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="packages, folders or .py files")
    parser.add_argument("--top", type=int, default=10, help="how many classes to print")
    args = parser.parse_args()
    print(f"{'methods':>7} {'attrs':>5}  class")
    for methods, attributes, name in class_sizes(args.paths)[: args.top]:
        print(f"{methods:7d} {attributes:5d}  {name}")


if __name__ == "__main__":
    main()
