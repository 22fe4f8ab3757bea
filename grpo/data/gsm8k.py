"""GSM8K from the dataset hub or from a local ``.parquet`` / ``.jsonl`` / ``.json`` file.

A preset of `grpo.data.prompt_dataset` whose gold answer is the number after ``####``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field

from grpo.config.options import checked_arguments
from grpo.data.dataset import PromptDataset
from grpo.data.loader import load_prompt_dataset
from grpo.data.sources import LOCAL_EXTENSIONS
from grpo.data.templates import PromptTemplate

__all__ = ["LOCAL_EXTENSIONS", "extract_gsm8k_answer", "gsm8k_dataset"]

_FINAL_ANSWER = re.compile(r"####\s*([-+]?\$?\s*[\d,]*\.?\d+)")


def extract_gsm8k_answer(solution: str) -> str | None:
    """The number after the last ``####`` of a GSM8K solution, without commas or ``$``
    (``"...\\n#### 1,234"`` -> ``"1234"``), or None when there is no ``#### <number>``."""
    matches = _FINAL_ANSWER.findall(solution)
    if not matches:
        return None
    number = re.sub(r"[\s,$]", "", matches[-1])
    return number.lstrip("+")


@checked_arguments
def gsm8k_dataset(
    source: str | os.PathLike = "openai/gsm8k",
    split: str = "train",
    config: str | None = "main",
    template: str | Mapping[str, Any] | PromptTemplate | None = None,
    system_prompt: str | None = None,
    num_examples: Annotated[int, Field(ge=1)] | None = None,
    max_skipped_examples: int = 5,
) -> PromptDataset:
    """Load GSM8K problems with their final numeric answers.

    Args:
        source (str | os.PathLike): A hub dataset name (``"openai/gsm8k"``) or a local file
            with columns ``question`` and ``answer``.
        split, config: Hub split and configuration name (``"main"``, ``"socratic"``);
            ignored for a local file.
        template: Prompt template, a name, a ``_component_`` mapping or a callable; defaults to
            ``"think_answer"``.
        system_prompt (str | None): System turn before each question; needs a chat template.
        num_examples (int | None): Keep only the first this many usable rows; ``None``: all.
        max_skipped_examples (int): How many skipped rows the report keeps, with their reasons.

    Returns:
        PromptDataset: Examples ``{"question": ..., "answer": "72"}``; unusable rows are counted
        in its ``skipped`` report.

    Raises:
        ValueError: On a source with no usable row; and as `grpo.data.sources.open_source`.
    """
    return load_prompt_dataset(
        source,
        prompt_key="question",
        answer_key="answer",
        split=split,
        subset=config,
        answer_extractor=extract_gsm8k_answer,
        system_prompt=system_prompt,
        template=template,
        default_template="think_answer",
        num_examples=num_examples,
        max_skipped_examples=max_skipped_examples,
        what="GSM8K",
        name_prefix="gsm8k:",
        no_answer_reason="answer has no '#### <number>' final answer",
    )
