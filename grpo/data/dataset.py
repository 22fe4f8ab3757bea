"""The prompt dataset container, the skipped-rows report and prompt-length filtering.

An example is a dict ``{"question": str, "answer": str}`` (the gold final answer), plus
``"messages"`` (chat turns the template renders instead of the question) when it came from a
conversation; ``PromptDataset[i]`` also carries the rendered ``"prompt"``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo.data.templates import PromptInput, PromptTemplate, chat_turns_problem


def template_input(example: dict) -> PromptInput:
    """What a template renders for ``example``: its chat turns if it has them, else its question."""
    messages = example.get("messages")
    return messages if messages is not None else example["question"]


@dataclass
class SkipReport:
    """Counts rows dropped while loading or filtering a dataset and keeps the first few reasons.

    Rows are numbered from 1 in the order of the source (the line number for ``.jsonl``).

    Args:
        source (str): What was read (a path or a hub name), used in the summary.
        max_examples (int): How many ``(row, reason)`` pairs to keep.
    """

    source: str
    max_examples: int = 5
    count: int = 0
    examples: list[tuple[int, str]] = field(default_factory=list)

    def add(self, row: int, reason: str) -> None:
        """Record that ``row`` was skipped because of ``reason``."""
        self.count += 1
        if len(self.examples) < self.max_examples:
            self.examples.append((row, reason))

    def copy(self) -> SkipReport:
        """An independent copy."""
        return SkipReport(self.source, self.max_examples, self.count, list(self.examples))

    def summary(self) -> str:
        """One line for the log, e.g. ``skipped 3 rows of x.jsonl: row 4: empty question; ...``."""
        noun = "row" if self.count == 1 else "rows"
        text = f"skipped {self.count} {noun} of {self.source}"
        if self.examples:
            text += ": " + "; ".join(f"row {row}: {reason}" for row, reason in self.examples)
        if self.count > len(self.examples) and self.examples:
            text += f"; ... ({self.count - len(self.examples)} more)"
        return text


class PromptDataset(Sequence):
    """A list of ``{"question", "answer"}`` examples with a prompt template attached.

    The first example is rendered at construction, so that a template that cannot render this
    dataset fails in the driver rather than in an actor.

    Args:
        template (PromptTemplate): Maps a question (or chat turns) to the prompt text; examples
            with ``messages`` need a chat template (``chat = True``).
        rows (list[int] | None): Source row number (from 1) of every example, for the reports
            of later filters; defaults to ``1..len(examples)``.

    Raises:
        ValueError: If an example lacks a string ``question`` or ``answer`` or has malformed
            ``messages``, ``rows`` has the wrong length, an example has chat turns but the
            template is a plain one, or the template fails on the first example.
    """

    def __init__(
        self,
        examples: list[dict[str, Any]],
        template: PromptTemplate,
        name: str = "prompts",
        rows: list[int] | None = None,
        skipped: SkipReport | None = None,
    ) -> None:
        for position, example in enumerate(examples):
            for key in ("question", "answer"):
                if not isinstance(example.get(key), str):
                    raise ValueError(
                        f"{name}: example {position} needs a string {key!r}, got {example!r}"
                    )
        if rows is not None and len(rows) != len(examples):
            raise ValueError(f"{name}: got {len(rows)} row numbers for {len(examples)} examples")
        self.examples = examples
        self.template = template
        self.name = name
        self.rows = list(rows) if rows is not None else list(range(1, len(examples) + 1))
        self.skipped = skipped if skipped is not None else SkipReport(name)
        for example, row in zip(examples, self.rows):
            if "messages" not in example:
                continue
            problem = chat_turns_problem(example["messages"])
            if problem:
                raise ValueError(f"{name}: row {row} has malformed 'messages': {problem}")
            if not getattr(template, "chat", False):
                raise ValueError(
                    f"{name}: row {row} holds chat turns, which the plain template {template!r} "
                    "cannot render; use the model's chat template: template: "
                    "{_component_: grpo.data.ChatTemplate, model_dir: <model folder>}"
                )
        if examples:
            self.prompt(0)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if isinstance(index, slice):
            raise TypeError(f"{self.name}: index must be an int, got a slice")
        index = operator.index(index)
        return {**self.examples[index], "prompt": self.prompt(index)}

    def prompt(self, index: int) -> str:
        """The rendered prompt of example ``index``.

        Raises:
            ValueError: If the template fails, naming the dataset and the source row.
        """
        try:
            return self.template(template_input(self.examples[index]))
        except (ValueError, TypeError) as error:
            raise ValueError(f"{self.name}: row {self.rows[index]}: {error}") from error

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, size={len(self)}, "
            f"template={self.template!r}, skipped={self.skipped.count})"
        )


def filter_long_prompts(
    dataset: PromptDataset,
    tokenizer_encode: Callable[[str], list[int]],
    max_prompt_tokens: int,
) -> PromptDataset:
    """Drop the examples whose rendered prompt is longer than ``max_prompt_tokens`` tokens.

    Dropped examples are added to the returned dataset's ``skipped`` report.

    Args:
        tokenizer_encode (Callable[[str], list[int]]): Encodes a prompt exactly as the sampler
            will (the same special tokens).

    Raises:
        ValueError: If ``max_prompt_tokens < 1`` or no prompt fits.
    """
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    skipped = dataset.skipped.copy()
    examples, rows = [], []
    for index, (example, row) in enumerate(zip(dataset.examples, dataset.rows)):
        num_tokens = len(tokenizer_encode(dataset.prompt(index)))
        if num_tokens > max_prompt_tokens:
            skipped.add(
                row, f"prompt has {num_tokens} tokens > max_prompt_tokens={max_prompt_tokens}"
            )
        else:
            examples.append(example)
            rows.append(row)
    if not examples:
        raise ValueError(
            f"{dataset.name}: all {len(dataset)} prompts are longer than "
            f"max_prompt_tokens={max_prompt_tokens}; {skipped.summary()}"
        )
    return PromptDataset(examples, dataset.template, dataset.name, rows, skipped)


def resolve_dataset(dataset: Any) -> Sequence[dict[str, Any]]:
    """A dataset object as it is, or one built from its ``_component_`` config node.

    Raises:
        TypeError: If ``dataset`` is neither a sequence of examples nor a mapping.
    """
    from collections.abc import Mapping

    if isinstance(dataset, Mapping):
        from grpo.config import instantiate

        return instantiate(dataset, _key_="dataset")
    if dataset is None or not isinstance(dataset, Sequence):
        raise TypeError(
            "dataset must be a sequence of {'question', 'answer'} dicts (e.g. a PromptDataset) "
            f"or a mapping with a _component_ key, got {type(dataset).__name__}"
        )
    return dataset
