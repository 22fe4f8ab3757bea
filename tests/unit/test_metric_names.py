"""A metric name declared in `grpo.observability.metric_names` is written out there only.

Every other module of the package, the recipes and the scripts names such a metric through its
constant (``TRAIN_LOSS``, ``REWARDS_FUNC_MEAN_TEMPLATE.format(name=...)``), so that renaming a
metric is one edit and no reader is left looking for the old name.
"""

from __future__ import annotations

import ast
import string
from dataclasses import dataclass
from pathlib import Path

from grpo.config import repo_root
from grpo.observability import metric_names
from grpo.observability.metric_names import METRIC_NAMES

# Folders whose modules must use the constants (tests may spell names out, but use them too).
SCANNED_FOLDERS = ("grpo", "recipes", "scripts")
DECLARING_MODULE = Path("grpo/observability/metric_names.py")


@dataclass(frozen=True)
class Declared:
    """What `metric_names` declares: full names, and templates of families of names.

    Args:
        constants (dict[str, str]): Metric name or template -> the constant that holds it
            (absent for `METRIC_NAMES` entries that have no constant).
        names (frozenset[str]): Full metric names.
        templates (frozenset[str]): `str.format` templates as declared.
        shapes (dict[str, str]): Each template with its fields written ``{}`` (to compare with
            f-strings whatever their fields are called) -> the template.
    """

    constants: dict[str, str]
    names: frozenset[str]
    templates: frozenset[str]
    shapes: dict[str, str]


def _shape_of_template(template: str) -> str:
    return "".join(
        literal + ("{}" if field is not None else "")
        for literal, field, _, _ in string.Formatter().parse(template)
    )


def _shape_of_fstring(node: ast.JoinedStr) -> str:
    return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)


def declared_metric_names() -> Declared:
    """The metric names and templates that `grpo.observability.metric_names` declares.

    Returns:
        Declared: Its upper-case string constants that hold a ``namespace/name`` (namespaces
        and step metrics have no ``/``), and every `METRIC_NAMES` entry.
    """
    constants = {
        value: attribute
        for attribute, value in vars(metric_names).items()
        if attribute.isupper() and isinstance(value, str) and "/" in value
    }
    values = set(constants) | {name for names in METRIC_NAMES.values() for name in names}
    templates = {value for value in values if "{" in value}
    return Declared(
        constants=constants,
        names=frozenset(values - templates),
        templates=frozenset(templates),
        shapes={_shape_of_template(template): template for template in templates},
    )


def metric_name_literals(source: str, declared: Declared) -> list[tuple[int, str, str]]:
    """The declared metric names and templates that `source` writes out as string literals.

    A plain string counts when it equals a declared name or template; an f-string when one of
    its constant parts is a declared name, or when its shape (fields as ``{}``) is that of a
    declared template (``f"ref_rewards/rewards_func_{fn}_mean"``). Names built from
    variables (``f"{prefix}/loss"``) are out of its reach.

    Args:
        source (str): Python source code.
        declared (Declared): What `declared_metric_names` returns.

    Returns:
        list[tuple[int, str, str]]: ``(line, literal as written, declared name or template)``
        per occurrence, in line order.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in declared.names or node.value in declared.templates:
                found.append((node.lineno, repr(node.value), node.value))
        elif isinstance(node, ast.JoinedStr):
            template = declared.shapes.get(_shape_of_fstring(node))
            if template is not None:
                found.append((node.lineno, ast.unparse(node), template))
    return sorted(found)


def test_metric_names_declare_names_and_templates():
    declared = declared_metric_names()
    assert "training/loss" in declared.names
    assert declared.constants["training/loss"] == "TRAIN_LOSS"
    assert "ref_rewards/rewards_func_{name}_mean" in declared.templates
    assert declared.shapes["ref_rewards/rewards_func_{}_mean"] == (
        "ref_rewards/rewards_func_{name}_mean"
    )
    # One constant per name: two constants holding one name would make either one a literal.
    holders: dict[str, list[str]] = {}
    for attribute, value in vars(metric_names).items():
        if attribute.isupper() and isinstance(value, str) and "/" in value:
            holders.setdefault(value, []).append(attribute)
    assert {value: names for value, names in holders.items() if len(names) > 1} == {}


def test_the_literal_finder_sees_strings_and_fstrings():
    source = '''
"""Logs ``training/loss``: a docstring naming a metric is no literal."""
LOSS = "training/loss"
metrics = {f"ref_rewards/rewards_func_{fn}_mean": 1.0, f"{prefix}/loss": 2.0}
joined = f"training/loss{suffix}"
other = "training/loss_typo"
'''
    found = metric_name_literals(source, declared_metric_names())
    loss, rewards_func = "training/loss", "ref_rewards/rewards_func_{name}_mean"
    assert found == [
        (3, repr(loss), loss),
        (4, "f'ref_rewards/rewards_func_{fn}_mean'", rewards_func),
        (5, repr(loss), loss),
    ]


def test_declared_metric_names_are_written_only_in_metric_names():
    root = repo_root()
    declared = declared_metric_names()
    offenders = []
    for folder in SCANNED_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root)
            if relative == DECLARING_MODULE:
                continue
            for line, literal, name in metric_name_literals(path.read_text(), declared):
                use = declared.constants.get(name, "a new constant of metric_names.py")
                offenders.append(f"{relative}:{line}: {literal} (use {use})")
    assert offenders == [], "metric names written out instead of named:\n" + "\n".join(offenders)
