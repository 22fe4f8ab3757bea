"""The config reference (`grpo.config.config_reference_markdown`) documents every key of the
schema in well-formed tables.
"""

from __future__ import annotations

import json

from grpo.config import (
    REQUIRED,
    RunConfig,
    Section,
    config_reference_markdown,
)
from grpo.config.schema import component_spec, default_of, section_type


def _schema_entries(model: type[Section] = RunConfig, prefix: str = ""):
    for key, info in model.model_fields.items():
        nested = section_type(info)
        if nested is not None:
            yield from _schema_entries(nested, f"{prefix}{key}.")
        else:
            yield prefix + key, info


def test_reference_markdown_documents_every_key():
    markdown = config_reference_markdown()
    entries = list(_schema_entries())
    assert len(entries) > 40
    for path, info in entries:
        rows = [line for line in markdown.splitlines() if line.startswith(f"| `{path}` |")]
        assert len(rows) == 1, path
        assert " ".join(info.description.split()) in rows[0], path
        default = default_of(info)
        spec = component_spec(info)
        if spec is None and default is not REQUIRED:
            assert f"`{json.dumps(default)}`" in rows[0], path
        if spec is not None and isinstance(default, dict):
            assert default["_component_"] in rows[0]
        if spec is not None and spec.args is not None:
            for name, arg in spec.args.model_fields.items():
                assert f"| `{path}.{name}` |" in markdown
                assert " ".join(arg.description.split()) in markdown
        if spec is not None and spec.many:
            assert "list of components" in rows[0]


def test_reference_markdown_tables_are_well_formed():
    # A "|" inside a description would split its row into extra cells.
    for line in config_reference_markdown().splitlines():
        if line.startswith("|"):
            assert line.count("|") == 5, line
