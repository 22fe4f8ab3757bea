"""Prompt templates: turn a dataset question, or a list of chat turns, into the prompt text.

A template is any callable ``prompt -> text``; the classes here also carry the ``stop`` strings
a sampler may stop on once the answer is closed.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

# A question string, or a conversation: a list of {"role": str, "content": str} turns.
PromptInput = str | list[dict[str, str]]
PromptTemplate = Callable[[PromptInput], str]

# The R1-Zero instruction: reason inside <think>, answer inside <answer>. Reward functions
# parse the <answer> tag, so every template here asks for it.
THINK_ANSWER_INSTRUCTION = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant "
    "solves it. The Assistant first thinks about the reasoning process in the mind and then "
    "provides the User with the answer. The reasoning process and answer are enclosed within "
    "<think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think> <answer> answer here </answer>."
)


def chat_turns_problem(turns: Any) -> str:
    """Why ``turns`` is not a list of ``{"role": str, "content": str}`` chat turns; ``""`` if it is."""
    if not isinstance(turns, list):
        return f"chat turns must be a list, got {type(turns).__name__}"
    if not turns:
        return "no chat turns"
    for number, turn in enumerate(turns, start=1):
        if not isinstance(turn, Mapping):
            return f"turn {number} is not a {{role, content}} mapping ({type(turn).__name__})"
        for key in ("role", "content"):
            if not isinstance(turn.get(key), str):
                return f"turn {number} has no string {key!r}"
    return ""


def last_user_content(turns: Sequence[Mapping[str, str]]) -> str | None:
    """The content of the last ``user`` turn (the question shown in logs), or None."""
    for turn in reversed(turns):
        if turn["role"] == "user":
            return turn["content"]
    return None


def _require_question_string(template: Any, question: Any) -> None:
    """Plain templates format a question string; chat turns need a chat template."""
    if not isinstance(question, str):
        raise TypeError(
            f"{template!r} renders a question string, got {type(question).__name__}; "
            "chat turns need a chat template: grpo.data.ChatTemplate"
        )


class AnswerOnlyTemplate:
    """The question on a line of its own; the model answers ``<answer>85</answer>`` directly.

    For models with no room to reason. The prompt ends with a newline, not a space, so that
    byte-level BPE tokenizers see a clean token boundary before the response.
    """

    name = "answer_only"
    stop: tuple[str, ...] = ("</answer>",)

    def __call__(self, question: str) -> str:
        _require_question_string(self, question)
        return f"{question}\n"

    def target(self, answer: str) -> str:
        """The response a perfect model gives to a question whose gold answer is ``answer``."""
        return f"<answer>{answer}</answer>"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ThinkAnswerTemplate:
    """R1-Zero prompt for base models: reason in ``<think>``, answer in ``<answer>``.

    The prompt is plain text, ``"<instruction>\\nUser: <question>\\nAssistant:"``; an instruct
    model takes `ChatTemplate` with the instruction as its system prompt instead.
    """

    name = "think_answer"
    stop: tuple[str, ...] = ("</answer>",)

    def __init__(self, instruction: str = THINK_ANSWER_INSTRUCTION) -> None:
        if not instruction.strip():
            raise ValueError("ThinkAnswerTemplate: instruction must be a non-empty string")
        self.instruction = instruction

    def __call__(self, question: str) -> str:
        _require_question_string(self, question)
        return f"{self.instruction}\nUser: {question}\nAssistant:"

    def target(self, answer: str, reasoning: str = "") -> str:
        """A well-formed response with the given reasoning and final answer."""
        return f"<think>{reasoning}</think>\n<answer>{answer}</answer>"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ChatTemplate:
    """Render prompts with the model folder's own chat template, as ``transformers`` does.

    The text is exactly ``apply_chat_template(turns, tokenize=False,
    add_generation_prompt=True)`` (a question string is one user turn). It already holds every
    special token, a leading bos included when the template writes one, so encode it without
    adding special tokens (``add_bos`` is False) or the prompt starts with two bos tokens.

    Args:
        system_prompt (str | None): System turn put first when a conversation has none; ``None``
            leaves that to the chat template.
        stop (Sequence[str]): Stop strings for the sampler; by default the end of the answer
            tag. ``[]`` stops at the model's end-of-turn token only.
        chat_template_kwargs (Mapping[str, Any] | None): Extra variables of the chat template
            (``{"enable_thinking": false}`` for Qwen3), for environment turns too.
        tools (Sequence | None): Tools to describe in the prompt, as a tool environment takes
            them (functions with type hints or their dotted paths).

    Raises:
        FileNotFoundError: If ``model_dir`` is not a folder.
        ValueError: If the folder has no chat template, or ``system_prompt`` is empty.
    """

    chat = True  # renders chat turns as well as question strings
    add_bos = False  # the rendered text holds the model's leading special tokens itself

    def __init__(
        self,
        model_dir: str | os.PathLike,
        system_prompt: str | None = None,
        stop: Sequence[str] = ("</answer>",),
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Any] | None = None,
    ) -> None:
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise ValueError(
                "ChatTemplate: chat_template_kwargs must be a mapping of template variables, "
                f"got {chat_template_kwargs!r}"
            )
        if system_prompt is not None and (
            not isinstance(system_prompt, str) or not system_prompt.strip()
        ):
            raise ValueError(
                f"ChatTemplate: system_prompt must be a non-empty string or null, "
                f"got {system_prompt!r}"
            )
        from grpo.models.tokenizer import load_tokenizer

        self.model_dir = str(Path(model_dir).expanduser().resolve())
        # The model's own tokenizer renders; it pickles as its path, so a dataset holding this
        # template stays cheap to send to Ray actors.
        self.tokenizer = load_tokenizer(self.model_dir)
        if not self.tokenizer.chat_template:  # fail now, in the driver
            raise ValueError(
                f"model folder {self.model_dir!r} has no chat template ('chat_template' in "
                "tokenizer_config.json or chat_template.jinja); use a plain template such as "
                "think_answer for a base model"
            )
        self.system_prompt = system_prompt
        self.stop: tuple[str, ...] = tuple(stop or ())
        self.chat_template_kwargs: dict[str, Any] = dict(chat_template_kwargs or {})
        self.tool_schemas: list[dict[str, Any]] | None = None
        if tools is not None and not isinstance(tools, (list, tuple)):
            raise ValueError(
                f"ChatTemplate: tools must be a list of functions or dotted paths, got {tools!r}"
            )
        if tools:
            from grpo.envs.tools import resolve_tools

            self.tool_schemas = [tool.schema() for tool in resolve_tools(list(tools)).values()]

    def messages(self, prompt: PromptInput) -> list[dict[str, str]]:
        """The chat turns rendered for ``prompt``: the system prompt (if any) and the turns.

        Raises:
            ValueError: If ``prompt`` is neither a string nor valid chat turns.
        """
        if isinstance(prompt, str):
            turns = [{"role": "user", "content": prompt}]
        else:
            problem = chat_turns_problem(prompt)
            if problem:
                raise ValueError(f"ChatTemplate: {problem}")
            turns = [{"role": turn["role"], "content": turn["content"]} for turn in prompt]
        if self.system_prompt is not None and turns[0]["role"] != "system":
            turns.insert(0, {"role": "system", "content": self.system_prompt})
        return turns

    def __call__(self, prompt: PromptInput) -> str:
        return self.tokenizer.apply_chat_template(
            self.messages(prompt), tools=self.tool_schemas, **self.chat_template_kwargs
        )

    def __repr__(self) -> str:
        system = self.system_prompt
        if system is not None and len(system) > 40:
            system = system[:40] + "..."
        return f"{type(self).__name__}(model_dir={self.model_dir!r}, system_prompt={system!r})"


TEMPLATES: dict[str, Callable[[], PromptTemplate]] = {
    "answer_only": AnswerOnlyTemplate,
    "think_answer": ThinkAnswerTemplate,
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
            ``_component_`` dotted path and keyword arguments, or a callable ``prompt -> str``.

    Raises:
        ValueError: If a name is not registered, or a ``_component_`` cannot be imported.
        TypeError: If ``spec`` is none of the accepted kinds.
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
