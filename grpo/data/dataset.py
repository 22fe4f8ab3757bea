"""The prompt dataset container, the skipped-rows report and prompt-length filtering.

An example is a plain dict ``{"question": str, "answer": str}``; ``answer`` is the gold final
answer as a plain string (``"85"``). A ``PromptDataset`` is a sequence of examples with the
prompt template attached: ``dataset[i]`` also carries the rendered ``"prompt"``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from grpo.data.templates import PromptTemplate


@dataclass
class SkipReport:
    """Counts rows dropped while loading or filtering a dataset and keeps the first few reasons.

    Rows are numbered from 1 in the order of the source (the line number for ``.jsonl``).

    Args:
        source (str): What was read (a path or a hub name), used in the summary.
        max_examples (int): How many ``(row, reason)`` pairs to keep.

    Example:
        >>> report = SkipReport("data/train.jsonl")
        >>> report.add(4, "empty question")
        >>> report.summary()
        'skipped 1 row of data/train.jsonl: row 4: empty question'
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

    Args:
        examples (list[dict[str, str]]): The examples; both values must be strings.
        template (PromptTemplate): Maps a question to the prompt text.
        name (str): Short description for logs, e.g. ``"gsm8k:data/train.jsonl"``.
        rows (list[int] | None): Source row number (from 1) of every example, used when a later
            filter reports what it dropped; defaults to ``1..len(examples)``.
        skipped (SkipReport | None): Rows dropped while building the dataset.

    Raises:
        ValueError: If an example lacks a string ``question`` or ``answer``, or ``rows`` has the
            wrong length.

    Example:
        >>> from grpo.data.templates import AnswerOnlyTemplate
        >>> ds = PromptDataset([{"question": "What is 1 + 2?", "answer": "3"}], AnswerOnlyTemplate())
        >>> ds[0]
        {'question': 'What is 1 + 2?', 'answer': '3', 'prompt': 'What is 1 + 2?\\n'}
    """

    def __init__(
        self,
        examples: list[dict[str, str]],
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

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, str]:
        if isinstance(index, slice):
            raise TypeError(f"{self.name}: index must be an int, got a slice")
        example = self.examples[operator.index(index)]
        return {**example, "prompt": self.template(example["question"])}

    def prompt(self, index: int) -> str:
        """The rendered prompt of example ``index``."""
        return self.template(self.examples[index]["question"])

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

    Dropped examples are counted in the returned dataset's ``skipped`` report (which also keeps
    everything the input's report counted), by their source row number.

    Args:
        dataset (PromptDataset): The dataset to filter; it is not modified.
        tokenizer_encode (Callable[[str], list[int]]): Encodes a prompt into token ids, exactly
            as the sampler will (same special tokens).
        max_prompt_tokens (int): Longest prompt kept, in tokens.

    Returns:
        PromptDataset: The kept examples, same template and name.

    Raises:
        ValueError: If ``max_prompt_tokens < 1`` or no prompt fits.

    Example:
        >>> short = filter_long_prompts(dataset, tokenizer.encode, max_prompt_tokens=512)
        >>> if short.skipped.count:
        ...     print(short.skipped.summary())
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
