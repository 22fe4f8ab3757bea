"""Prompt templates: turn a dataset question into the text the policy is prompted with.

A template is any callable ``question -> prompt``. The classes here also carry the matching
response format (``target``), used to build supervised targets for the demo model, and
``stop`` strings a sampler may stop on once the answer is closed.

Templates are chosen in a dataset factory's ``template`` option, either as a string name
(``"answer_only"``, ``"think_answer"``, ``"think_answer_chat"``), as a ``_component_`` mapping
(``{_component_: grpo.data.ThinkAnswerTemplate, chat: true}``) or as an instance.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

PromptTemplate = Callable[[str], str]

# The R1-Zero instruction: reason inside <think>, answer inside <answer>. Reward functions
# parse the <answer> tag, so every template here asks for it.
THINK_ANSWER_INSTRUCTION = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant "
    "solves it. The Assistant first thinks about the reasoning process in the mind and then "
    "provides the User with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think> <answer> answer here </answer>."
)


class AnswerOnlyTemplate:
    """The question on a line of its own; the model answers ``<answer>85</answer>`` directly.

    Used by the tiny arithmetic demo model, which has no room to reason. The prompt ends with a
    newline rather than a space so that byte-level BPE tokenizers see a clean token boundary
    before the response.

    Example:
        >>> template = AnswerOnlyTemplate()
        >>> template("What is 37 + 48?")
        'What is 37 + 48?\\n'
        >>> template.target("85")
        '<answer>85</answer>'
    """

    name = "answer_only"
    stop: tuple[str, ...] = ("</answer>",)

    def __call__(self, question: str) -> str:
        return f"{question}\n"

    def target(self, answer: str) -> str:
        """The response a perfect model gives to a question whose gold answer is ``answer``."""
        return f"<answer>{answer}</answer>"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ThinkAnswerTemplate:
    """R1-style prompt: reason in ``<think>...</think>``, answer in ``<answer>...</answer>``.

    With ``chat=False`` the prompt is the plain R1-Zero text for base models
    (``"<instruction>\\nUser: <question>\\nAssistant:"``). With ``chat=True`` it is ChatML, the
    chat format of Qwen2.5 instruct models, with the instruction as the system message; the
    text is exactly what ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``
    produces for those models, so vLLM can be fed the string directly.

    Args:
        chat (bool): Emit ChatML (``<|im_start|>system/user/assistant``) instead of plain text.
        instruction (str): The instruction; defaults to the R1-Zero wording.

    Example:
        >>> print(ThinkAnswerTemplate(chat=True)("What is 2 + 2?").splitlines()[-1])
        <|im_start|>assistant
    """

    stop: tuple[str, ...] = ("</answer>",)

    def __init__(self, chat: bool = False, instruction: str = THINK_ANSWER_INSTRUCTION) -> None:
        if not instruction.strip():
            raise ValueError("ThinkAnswerTemplate: instruction must be a non-empty string")
        self.chat = bool(chat)
        self.instruction = instruction
        self.name = "think_answer_chat" if self.chat else "think_answer"

    def __call__(self, question: str) -> str:
        if self.chat:
            return (
                f"<|im_start|>system\n{self.instruction}<|im_end|>\n"
                f"<|im_start|>user\n{question}<|im_end|>\n"
                f"<|im_start|>assistant\n"
            )
        return f"{self.instruction}\nUser: {question}\nAssistant:"

    def target(self, answer: str, reasoning: str = "") -> str:
        """A well-formed response with the given reasoning and final answer."""
        return f"<think>{reasoning}</think>\n<answer>{answer}</answer>"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(chat={self.chat})"


TEMPLATES: dict[str, Callable[[], PromptTemplate]] = {
    "answer_only": AnswerOnlyTemplate,
    "think_answer": ThinkAnswerTemplate,
    "think_answer_chat": lambda: ThinkAnswerTemplate(chat=True),
}


def _import_object(dotted_path: str) -> Any:
    """Import ``package.module.attr`` and return ``attr``."""
    module_name, _, attr = dotted_path.rpartition(".")
    if not module_name:
        raise ValueError(
            f"_component_ must be a dotted path like 'pkg.mod.Name', got {dotted_path!r}"
        )
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot import template _component_ {dotted_path!r}: {error}") from error


def resolve_template(
    spec: str | Mapping[str, Any] | PromptTemplate | None, default: str
) -> PromptTemplate:
    """Turn a template option from a config into a template.

    Args:
        spec: ``None`` (use ``default``), a registered name (see ``TEMPLATES``), a mapping with a
            ``_component_`` dotted path and keyword arguments, or a callable ``str -> str``.
        default (str): Registered name used when ``spec`` is ``None``.

    Returns:
        PromptTemplate: A callable mapping a question to a prompt.

    Raises:
        ValueError: If a name is not registered, or a ``_component_`` cannot be imported.
        TypeError: If ``spec`` is none of the accepted kinds.

    Example:
        >>> resolve_template({"_component_": "grpo.data.ThinkAnswerTemplate", "chat": True}, "answer_only")
        ThinkAnswerTemplate(chat=True)
    """
    if spec is None:
        spec = default
    if isinstance(spec, str):
        if spec not in TEMPLATES:
            raise ValueError(f"unknown template {spec!r}; expected one of {sorted(TEMPLATES)}")
        return TEMPLATES[spec]()
    if isinstance(spec, Mapping):
        kwargs = dict(spec)
        component = kwargs.pop("_component_", None)
        if not isinstance(component, str):
            raise ValueError(
                f"template mapping needs a '_component_' dotted path, got {dict(spec)!r}"
            )
        return _import_object(component)(**kwargs)
    if callable(spec):
        return spec
    raise TypeError(
        f"template must be a name, a _component_ mapping or a callable, got {type(spec).__name__}"
    )
