"""The config reference (``docs/config.md``), rendered from the declared sections."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from grpo.config.run import RunConfig
from grpo.config.schema import (
    COMPONENT_DEFAULT,
    REQUIRED,
    Section,
    component_spec,
    constraints_of,
    default_of,
    section_type,
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


def _doc(model: type[BaseModel], key: str) -> str:
    info = model.model_fields[key]
    text = " ".join((info.description or "").split())
    bounds = constraints_of(info)
    return f"{text} ({bounds})" if bounds else text


def _title(model: type[BaseModel]) -> str:
    return (model.__doc__ or model.__name__).strip().splitlines()[0].rstrip(".")


def config_reference_markdown() -> str:
    """Every config key with its type, default and description: one Markdown table per section."""
    lines: list[str] = []

    def table(model: type[Section], prefix: str, title: str) -> None:
        rows: list[str] = []
        nested: list[tuple[type[Section], str]] = []
        for key, info in model.model_fields.items():
            path = prefix + key
            child = section_type(info)
            if child is not None:
                nested.append((child, f"{path}."))
                continue
            spec = component_spec(info)
            default = _format_default(default_of(info))
            if spec is None:
                kind = type_name(info.annotation)
            elif spec.many:
                kind = "list of components"
            else:
                kind = "component or null" if default_of(info) is None else "component"
            rows.append(f"| `{path}` | {kind} | {default} | {_doc(model, key)} |")
            if spec is not None and spec.args is not None:
                for name, arg in spec.args.model_fields.items():
                    rows.append(
                        f"| `{path}.{name}` | {type_name(arg.annotation)} | "
                        f"{_format_default(arg.default)} | {_doc(spec.args, name)} |"
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
            table(child, child_prefix, f"`{child_prefix[:-1]}`: {_title(child)}")

    table(RunConfig, "", _title(RunConfig))
    return "\n".join(lines)
