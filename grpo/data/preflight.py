"""Cheap checks of a dataset node, for ``grpo validate`` to run before any actor starts.

They read no more than a file's header or first rows, never the network and never torch: a
preview of the loader's own errors, which stay the authority.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grpo.data.sources import LOCAL_EXTENSIONS, _read_json, looks_like_path
from grpo.data.templates import TEMPLATES, chat_turns_problem

_PROMPT_DATASETS = ("grpo.data.prompt_dataset", "grpo.data.loader.prompt_dataset")
_GSM8K_DATASETS = ("grpo.data.gsm8k_dataset", "grpo.data.gsm8k.gsm8k_dataset")
_ARITHMETIC_DATASETS = ("grpo.data.arithmetic_dataset", "grpo.data.arithmetic.arithmetic_dataset")
_PLAIN_TEMPLATE_CLASSES = ("AnswerOnlyTemplate", "ThinkAnswerTemplate")
_DEFAULT_TEMPLATE = "think_answer"  # the default of both dataset factories
_PEEK_ROWS = 20
_MAX_JSON_BYTES = 50 * 2**20


def _chat_advice(key: str) -> str:
    """How to switch the dataset at `key` to the model's chat template, in YAML and overrides."""
    return (
        "use the model's chat template: template: {_component_: grpo.data.ChatTemplate, "
        f"model_dir: ${{base_model_path}}}} (on the command line: {key}.template._component_="
        f"grpo.data.ChatTemplate '{key}.template.model_dir=${{base_model_path}}')"
    )


def dataset_problems(key: str, node: dict, base_model_path: str | None) -> list[str]:
    """Cheap checks of one dataset `_component_` node (plain dict, interpolations already resolved).

    Checks a local source's file, extension and columns, that chat turns or a ``system_prompt``
    come with a chat template, and that a template exists; hub names are not checked.

    Args:
        key (str): Config key of the node, the prefix of every message (``"dataset"``).
        base_model_path (str | None): The run's model folder: a `ChatTemplate` without
            ``model_dir`` is checked against it.

    Returns:
        list[str]: One ``"<key>.<option>: what is wrong"`` line per problem; ``[]`` if none.
    """
    component = node.get("_component_")
    if component in _PROMPT_DATASETS:
        source = node.get("source")
        prompt_key = node.get("prompt_key", "prompt")
        columns = [("prompt_key", prompt_key), ("answer_key", node.get("answer_key", "answer"))]
        hint = ""
    elif component in _GSM8K_DATASETS:
        source = node.get("source", "openai/gsm8k")
        prompt_key = "question"  # gsm8k_dataset's columns are fixed
        columns = [("source", "question"), ("source", "answer")]
        hint = "; gsm8k_dataset needs columns question and answer"
    else:
        # Another dataset: only its chat template folder, if it names one, is checked here.
        problems = _arithmetic_problems(key, node) if component in _ARITHMETIC_DATASETS else []
        template = node.get("template")
        if isinstance(template, Mapping):
            problems += _chat_template_problems(f"{key}.template", template, base_model_path)
        return problems

    problems: list[str] = []
    template = node.get("template")
    plain = _plain_template_name(template)
    if isinstance(template, str) and template not in TEMPLATES:
        problems.append(
            f"{key}.template: unknown template {template!r}; expected one of "
            f"{', '.join(sorted(TEMPLATES))}, or a ChatTemplate node"
        )
        plain = None
    if isinstance(template, Mapping):
        problems.extend(_chat_template_problems(f"{key}.template", template, base_model_path))
    if node.get("system_prompt") is not None and plain is not None:
        problems.append(
            f"{key}.system_prompt: a system prompt is a chat turn, which the plain template "
            f"{plain!r} cannot render; {_chat_advice(key)}"
        )

    if not isinstance(source, str) or not source or not looks_like_path(source):
        return problems  # a hub name (no network here), or a type error reported elsewhere
    path = Path(source).expanduser()
    if not path.exists():
        return [*problems, f"{key}.source: file {source} does not exist"]
    suffix = path.suffix.lower()
    if not path.is_file():
        return [*problems, f"{key}.source: {source} is not a file"]
    if suffix not in LOCAL_EXTENSIONS:
        return [
            *problems,
            f"{key}.source: unsupported file extension {suffix!r} for {source}; expected one "
            f"of {', '.join(LOCAL_EXTENSIONS)}",
        ]
    if not isinstance(prompt_key, str):
        return problems  # a type error, reported by the config checks
    try:
        peek = _peek(path, suffix, prompt_key)
    except Exception:  # unreadable or malformed: the loader reports it with its own words
        return problems
    if peek is None:
        return problems
    names, rows, complete = peek
    if names:  # a file without object rows is reported row by row by the loader
        where = source if complete else f"the first {_PEEK_ROWS} rows of {source}"
        for option, column in columns:
            if isinstance(column, str) and column not in names:
                problems.append(
                    f"{key}.{option}: column {column!r} not in {where}; its columns: "
                    f"{', '.join(names)}{hint}"
                )
    if plain is not None and any(_is_chat_turns(row.get(prompt_key)) for row in rows):
        problems.append(
            f"{key}.template: column {prompt_key!r} holds chat turns, which the plain template "
            f"{plain!r} cannot render; {_chat_advice(key)}"
        )
    return problems


def _plain_template_name(template: Any) -> str | None:
    """The name of a template known to render question strings only; None if chat or unknown."""
    if template is None:
        return _DEFAULT_TEMPLATE
    if isinstance(template, str):
        return template
    if isinstance(template, Mapping) and isinstance(template.get("_component_"), str):
        name = template["_component_"].rpartition(".")[2]
        if name in _PLAIN_TEMPLATE_CLASSES:
            return name  # a custom component may render chat turns: it is not judged here
    return None


def _is_chat_turns(value: Any) -> bool:
    return isinstance(value, list) and not chat_turns_problem(value)


def _peek(path: Path, suffix: str, prompt_key: str) -> tuple[list[str], list[dict], bool] | None:
    """``(column names, first rows, whether the names cover the whole file)``; None to skip."""
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        names = list(pq.read_schema(path).names)
        rows: list[dict] = []
        if prompt_key in names:  # only the first batch of the prompt column is read
            batches = pq.ParquetFile(path).iter_batches(batch_size=_PEEK_ROWS, columns=[prompt_key])
            rows = next(batches).to_pylist()
        return names, rows, True
    if suffix == ".jsonl":
        values, complete = [], True
        with path.open(encoding="utf-8") as file:
            for line in file:
                if not line.strip():
                    continue
                if len(values) == _PEEK_ROWS:
                    complete = False
                    break
                try:
                    values.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # an invalid line is skipped and counted by the loader
    else:  # .json: the whole file, when small enough
        if path.stat().st_size > _MAX_JSON_BYTES:
            return None
        values, complete = [row for _, row in _read_json(path)], True
    rows = [row for row in values if isinstance(row, Mapping)]
    names = list(dict.fromkeys(name for row in rows for name in row))
    return names, rows[:_PEEK_ROWS], complete


def _chat_template_problems(
    key: str, template: Mapping[str, Any], base_model_path: str | None
) -> list[str]:
    """A ChatTemplate node whose model folder is missing or has no chat template, or whose
    template variables or tools are not what it takes."""
    component = template.get("_component_")
    if not isinstance(component, str) or component.rpartition(".")[2] != "ChatTemplate":
        return []
    kwargs = template.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        return [
            f"{key}.chat_template_kwargs: expected a mapping of template variables (e.g. "
            f"{{enable_thinking: false}}), got {kwargs!r}"
        ]
    tools = template.get("tools")
    if tools is not None and not isinstance(tools, list):
        return [f"{key}.tools: expected a list of dotted paths of functions, got {tools!r}"]
    model_dir = template.get("model_dir", base_model_path)
    if not isinstance(model_dir, str) or not model_dir:
        return []
    folder = Path(model_dir).expanduser()
    if not folder.is_dir():
        if "model_dir" not in template:
            return []  # base_model_path is checked, and reported, on its own
        return [f"{key}.model_dir: model folder {model_dir} does not exist"]
    try:
        if _has_chat_template(folder):
            return []
    except Exception:  # e.g. invalid tokenizer_config.json: the tokenizer reports it
        return []
    where = model_dir if "model_dir" in template else f"{model_dir} (base_model_path)"
    return [
        f"{key}.model_dir: {where} has no chat template (tokenizer_config.json has no "
        "chat_template, no chat_template.jinja); use a plain template such as think_answer "
        "for a base model, or a model folder that has one"
    ]


def _has_chat_template(folder: Path) -> bool:
    """Whether ``AutoTokenizer.from_pretrained(folder).chat_template`` would be set."""
    if (folder / "chat_template.jinja").is_file():
        return True
    if any((folder / "additional_chat_templates").glob("*.jinja")):
        return True
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return False
    config = json.loads(config_path.read_text(encoding="utf-8"))
    return isinstance(config, Mapping) and bool(config.get("chat_template"))


def _arithmetic_problems(key: str, node: dict) -> list[str]:
    """What `arithmetic_dataset` would raise about its arguments together (min above max, no
    drawable operation or digit count): `grpo.data.arithmetic.arithmetic_problem`. A value of
    the wrong type is its option check's to report."""
    from grpo.data.arithmetic import arithmetic_problem

    names = ("operations", "min_value", "max_value", "operand_digits")
    arguments = {name: node[name] for name in names if name in node}
    if any(isinstance(arguments.get(name), bool) for name in ("min_value", "max_value")) or not all(
        isinstance(arguments.get(name, 0), int) for name in ("min_value", "max_value")
    ):
        return []
    problem = arithmetic_problem(**arguments)
    return [] if problem is None else [f"{key}.{problem}"]
