"""The config reference of the README, rendered from the declared options."""

from __future__ import annotations

import json
from typing import Any

from grpo.config.options import (
    COMPONENT_DEFAULT,
    REQUIRED,
    Component,
    Field,
    Section,
    run_schema,
    type_name,
)


def _format_default(value: Any) -> str:
    if value is REQUIRED:
        return "**required**"
    if value is COMPONENT_DEFAULT:
        return "(component's)"
    if isinstance(value, dict) and "_component_" in value:
        rest = {k: v for k, v in value.items() if k != "_component_"}
        extra = ", " + ", ".join(f"{k}: {v}" for k, v in rest.items()) if rest else ""
        return f"`{value['_component_']}`{extra}"
    return f"`{json.dumps(value)}`"


def config_reference_markdown() -> str:
    """Render every config key with its type, default and description as Markdown tables.

    Returns:
        str: One table per section, for the README.
    """
    lines: list[str] = []

    def table(section: Section, prefix: str, title: str) -> None:
        rows: list[str] = []
        nested: list[tuple[Section, str]] = []
        for key, spec in section.fields.items():
            path = prefix + key
            if isinstance(spec, Section):
                nested.append((spec, f"{path}."))
            elif isinstance(spec, Field):
                rows.append(
                    f"| `{path}` | {type_name(spec.types)} | "
                    f"{_format_default(spec.default)} | {spec.doc} |"
                )
            elif isinstance(spec, Component):
                optional = " or null" if spec.default is None else ""
                rows.append(
                    f"| `{path}` | component{optional} | "
                    f"{_format_default(spec.default)} | {spec.doc} |"
                )
                for name, kwarg in spec.kwargs.items():
                    rows.append(
                        f"| `{path}.{name}` | {type_name(kwarg.types)} | "
                        f"{_format_default(kwarg.default)} | {kwarg.doc} |"
                    )
            else:
                rows.append(
                    f"| `{path}` | list of components | "
                    f"{_format_default(spec.default)} | {spec.doc} |"
                )
        if rows:
            lines.extend(
                [
                    f"### {title}",
                    "",
                    "| Key | Type | Default | Description |",
                    "|---|---|---|---|",
                    *rows,
                    "",
                ]
            )
        for child, child_prefix in nested:
            table(child, child_prefix, f"`{child_prefix[:-1]}`: {child.doc}")

    schema = run_schema()
    table(schema, "", schema.doc)
    return "\n".join(lines)
