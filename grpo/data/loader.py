"""A prompt dataset from any hub dataset or local file, with the column names given in the config
(docs/data-and-rewards.md).

Rows that cannot be used are skipped and counted by their row number in the source; a problem
with the source as a whole (missing file or column) fails at once.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any

from pydantic import Field

from grpo.config.options import checked_arguments
from grpo.data.dataset import PromptDataset, SkipReport, template_input
from grpo.data.sources import InvalidRow, open_source
from grpo.data.templates import (
    PromptTemplate,
    chat_turns_problem,
    last_user_content,
    resolve_template,
)

AnswerExtractor = Callable[[str], str | None]

# An example's own keys: a column of one of these names is not passed through (a "messages"
# column beside a question would otherwise be rendered instead of it).
EXAMPLE_KEYS = frozenset({"question", "answer", "messages", "prompt", "index"})


class RegexAnswerExtractor:
    """The last match of a regular expression in a solution: its first group if it has groups.

    Args:
        pattern (str): Regular expression, searched anywhere in the text.
        remove (str): Characters deleted from the match (e.g. ``",$"`` for ``$1,234``).

    Raises:
        ValueError: If ``pattern`` is not a valid regular expression.
    """

    def __init__(self, pattern: str, remove: str = "") -> None:
        try:
            self.regex = re.compile(pattern)
        except re.error as error:
            raise ValueError(
                f"RegexAnswerExtractor: invalid pattern {pattern!r}: {error}"
            ) from None
        self.pattern = pattern
        self.remove = remove

    def __call__(self, solution: str) -> str | None:
        matches = list(self.regex.finditer(solution))
        if not matches:
            return None
        last = matches[-1]
        text = last.group(1) if self.regex.groups else last.group(0)
        if text is None:
            return None
        text = text.translate({ord(char): None for char in self.remove}).strip()
        return text or None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.pattern!r}, remove={self.remove!r})"


def resolve_answer_extractor(spec: str | AnswerExtractor | None) -> AnswerExtractor | None:
    """An answer extractor from a config value: ``None``, a callable ``str -> str | None``, or a
    function's dotted path.

    Raises:
        ValueError: If a dotted path does not import, or ``spec`` is not callable.
    """
    if spec is None or callable(spec):
        return spec
    if isinstance(spec, str):
        module_name, _, attr = spec.rpartition(".")
        try:
            extractor = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError) as error:
            raise ValueError(
                f"answer_extractor {spec!r}: cannot import it ({error}); expected the dotted "
                "path of a function str -> str | None, e.g. grpo.data.extract_gsm8k_answer"
            ) from None
        if callable(extractor):
            return extractor
    raise ValueError(
        f"answer_extractor must be a callable str -> str | None, a function's dotted path or a "
        f"_component_ node, got {spec!r}"
    )


def _row_example(
    row: Any,
    prompt_key: str,
    answer_key: str,
    extractor: AnswerExtractor | None,
    no_answer_reason: str,
) -> tuple[dict[str, Any] | None, str]:
    """Validate one raw row; return ``(example, "")`` or ``(None, reason)``."""
    if isinstance(row, InvalidRow):
        return None, row.reason
    if not isinstance(row, Mapping):
        return None, f"not an object with {prompt_key!r} and {answer_key!r} ({type(row).__name__})"
    prompt = row.get(prompt_key)
    messages = None
    if prompt is None:
        return None, f"missing {prompt_key}"
    if isinstance(prompt, list):
        problem = chat_turns_problem(prompt)
        if problem:
            return None, f"{prompt_key}: {problem}"
        messages = [{"role": turn["role"], "content": turn["content"]} for turn in prompt]
        question = last_user_content(messages)
        if question is None:
            return None, f"{prompt_key} has no user turn"
    elif not isinstance(prompt, str):
        return None, f"{prompt_key} is not a string ({type(prompt).__name__})"
    elif not prompt.strip():
        return None, f"empty {prompt_key}"
    else:
        question = prompt.strip()
    answer = row.get(answer_key)
    if answer is None:
        return None, f"missing {answer_key}"
    # Many datasets store numeric answers as numbers; the rewards compare text.
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        return None, f"{answer_key} is not a string ({type(answer).__name__})"
    answer = str(answer).strip()
    if not answer:
        return None, f"empty {answer_key}"
    if extractor is not None:
        extracted = extractor(answer)
        if extracted is None:
            return None, no_answer_reason
        if not isinstance(extracted, str):
            raise TypeError(
                f"answer_extractor {extractor!r} returned {type(extracted).__name__} for "
                f"{answer!r}; expected a string or None"
            )
        answer = extracted
    # The row's other columns ride along for an environment that reads them.
    example: dict[str, Any] = {
        column: value
        for column, value in row.items()
        if column not in EXAMPLE_KEYS and column not in (prompt_key, answer_key)
    }
    example.update(question=question, answer=answer)
    if messages is not None:
        example["messages"] = messages
    return example, ""


def load_prompt_dataset(
    source: str | os.PathLike,
    *,
    prompt_key: str,
    answer_key: str,
    split: str,
    subset: str | None,
    answer_extractor: str | AnswerExtractor | None,
    system_prompt: str | None,
    template: str | Mapping[str, Any] | PromptTemplate | None,
    default_template: str,
    num_examples: int | None,
    max_skipped_examples: int,
    what: str,
    name_prefix: str,
    no_answer_reason: str,
) -> PromptDataset:
    """`prompt_dataset` with the wording of its messages as arguments (for presets like GSM8K)."""
    for key, value in (("prompt_key", prompt_key), ("answer_key", answer_key)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{key} must be a column name, got {value!r}")
    if system_prompt is not None and (not isinstance(system_prompt, str) or not system_prompt):
        raise ValueError(f"system_prompt must be a non-empty string or null, got {system_prompt!r}")
    extractor = resolve_answer_extractor(answer_extractor)
    template = resolve_template(template, default=default_template)
    is_chat = bool(getattr(template, "chat", False))
    if system_prompt is not None and not is_chat:
        raise ValueError(
            f"system_prompt is a chat turn, which the plain template {template!r} cannot "
            "render; use the model's chat template: template: "
            "{_component_: grpo.data.ChatTemplate, model_dir: <model folder>}"
        )

    opened = open_source(source, (prompt_key, answer_key), split=split, subset=subset, what=what)
    skipped = SkipReport(opened.label, max_examples=max_skipped_examples)
    examples, rows = [], []
    for row_number, row in opened.rows:
        if num_examples is not None and len(examples) == num_examples:
            break
        example, reason = _row_example(row, prompt_key, answer_key, extractor, no_answer_reason)
        if example is None:
            skipped.add(row_number, reason)
            continue
        if system_prompt is not None:
            turns = example.get("messages") or [{"role": "user", "content": example["question"]}]
            if turns[0]["role"] != "system":
                turns = [{"role": "system", "content": system_prompt}, *turns]
            example["messages"] = turns
        if "messages" in example and not is_chat:
            raise ValueError(
                f"{opened.label}: row {row_number}: column {prompt_key!r} holds chat turns, "
                f"which the plain template {template!r} cannot render; use the model's chat "
                "template: template: {_component_: grpo.data.ChatTemplate, model_dir: "
                "<model folder>}"
            )
        # A row the template cannot render is skipped here, not in an actor mid-run.
        try:
            template(template_input(example))
        except (ValueError, TypeError) as error:
            skipped.add(row_number, f"template failed: {error}")
            continue
        examples.append(example)
        rows.append(row_number)
    if not examples:
        raise ValueError(f"no usable {what} rows in {opened.label}; {skipped.summary()}")
    return PromptDataset(
        examples, template, name=f"{name_prefix}{opened.label}", rows=rows, skipped=skipped
    )


@checked_arguments
def prompt_dataset(
    source: str | os.PathLike,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    split: str = "train",
    subset: str | None = None,
    answer_extractor: str | AnswerExtractor | None = None,
    system_prompt: str | None = None,
    template: str | Mapping[str, Any] | PromptTemplate | None = None,
    num_examples: Annotated[int, Field(ge=1)] | None = None,
    max_skipped_examples: int = 5,
) -> PromptDataset:
    """Load prompts and gold answers from a hub dataset or a local file.

    Args:
        source (str | os.PathLike): A hub dataset name (loaded with ``datasets.load_dataset``)
            or a local ``.parquet`` / ``.jsonl`` / ``.json`` file.
        prompt_key (str): Column of the prompt: a question string, or a list of chat turns
            (needs a chat template).
        answer_key (str): Column of the gold answer (a string or a number).
        split, subset: Hub split and configuration name (``"main"``); ignored for a local file.
        answer_extractor: Maps the answer column to the gold final answer, or to ``None`` for a
            row to skip: a callable, a function's dotted path or a ``_component_`` node.
            ``None`` keeps the column as it is.
        system_prompt (str | None): System turn put first in every conversation that has none;
            needs a chat template.
        template: Prompt template: a name, a ``_component_`` mapping, or a callable; defaults
            to ``"think_answer"``.
        num_examples (int | None): Keep only the first this many usable rows; ``None``: all.
        max_skipped_examples (int): How many skipped rows the report keeps, with their reasons.

    Returns:
        PromptDataset: Examples ``{"question", "answer"}``, plus ``"messages"`` for chat turns,
        plus the row's other columns under their own names (but an example's own keys).

    Raises:
        ValueError: On a source lacking ``prompt_key`` or ``answer_key``, chat turns or
            ``system_prompt`` with a plain template, or no usable row; and as
            `grpo.data.sources.open_source`.
    """
    extractor_name = getattr(answer_extractor, "__name__", None) or repr(answer_extractor)
    return load_prompt_dataset(
        source,
        prompt_key=prompt_key,
        answer_key=answer_key,
        split=split,
        subset=subset,
        answer_extractor=answer_extractor,
        system_prompt=system_prompt,
        template=template,
        default_template="think_answer",
        num_examples=num_examples,
        max_skipped_examples=max_skipped_examples,
        what="dataset",
        name_prefix="",
        no_answer_reason=f"answer_extractor {extractor_name} found no answer in {answer_key}",
    )
