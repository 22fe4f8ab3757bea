"""Datasets, prompt templates and the per-worker prompt stream (docs/data-and-rewards.md)."""

from grpo.data.arithmetic import arithmetic_dataset, question_split
from grpo.data.dataset import PromptDataset, SkipReport, filter_long_prompts, template_input
from grpo.data.gsm8k import extract_gsm8k_answer, gsm8k_dataset
from grpo.data.loader import RegexAnswerExtractor, prompt_dataset, resolve_answer_extractor
from grpo.data.sources import LOCAL_EXTENSIONS, open_source
from grpo.data.stream import PromptStream
from grpo.data.templates import (
    TEMPLATES,
    THINK_ANSWER_INSTRUCTION,
    AnswerOnlyTemplate,
    ChatTemplate,
    PromptTemplate,
    ThinkAnswerTemplate,
    chat_turns_problem,
    last_user_content,
    resolve_template,
)

__all__ = [
    "LOCAL_EXTENSIONS",
    "TEMPLATES",
    "THINK_ANSWER_INSTRUCTION",
    "AnswerOnlyTemplate",
    "ChatTemplate",
    "PromptDataset",
    "PromptStream",
    "PromptTemplate",
    "RegexAnswerExtractor",
    "SkipReport",
    "ThinkAnswerTemplate",
    "arithmetic_dataset",
    "chat_turns_problem",
    "extract_gsm8k_answer",
    "filter_long_prompts",
    "gsm8k_dataset",
    "last_user_content",
    "open_source",
    "prompt_dataset",
    "question_split",
    "resolve_answer_extractor",
    "resolve_template",
    "template_input",
]
