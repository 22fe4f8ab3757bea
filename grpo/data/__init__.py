"""Datasets, prompt templates and the per-worker prompt stream.

Config usage::

    dataset:
      _component_: grpo.data.arithmetic_dataset
      num_examples: 10000
      template: answer_only            # or {_component_: grpo.data.AnswerOnlyTemplate}
"""

from grpo.data.arithmetic import arithmetic_dataset, question_split
from grpo.data.dataset import PromptDataset, SkipReport, filter_long_prompts
from grpo.data.gsm8k import extract_gsm8k_answer, gsm8k_dataset
from grpo.data.stream import PromptStream
from grpo.data.templates import (
    TEMPLATES,
    THINK_ANSWER_INSTRUCTION,
    AnswerOnlyTemplate,
    PromptTemplate,
    ThinkAnswerTemplate,
    resolve_template,
)

__all__ = [
    "TEMPLATES",
    "THINK_ANSWER_INSTRUCTION",
    "AnswerOnlyTemplate",
    "PromptDataset",
    "PromptStream",
    "PromptTemplate",
    "SkipReport",
    "ThinkAnswerTemplate",
    "arithmetic_dataset",
    "extract_gsm8k_answer",
    "filter_long_prompts",
    "gsm8k_dataset",
    "question_split",
    "resolve_template",
]
