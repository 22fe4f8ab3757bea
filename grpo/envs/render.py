"""The environment's turns as tokens: token in, token out (docs/environments.md).

Text the model wrote is never decoded and encoded again: `ChatTurnRenderer` keeps only what the
chat template writes after a marker standing for the policy's last turn, never its rendering of
the history, so templates that rewrite earlier turns still extend the sampled tokens. Plain-text
prompts use `PlainTurnRenderer`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_MARKER = "\x00grpo-assistant-turn\x00"
# The shortest conversation an assistant turn follows: what `ChatTurnRenderer.env_tokens`
# renders after when it is given no history.
_FIRST_TURN: tuple[dict[str, str], ...] = ({"role": "user", "content": "?"},)
# Conversations the template is checked on before a run. The last has an earlier tool exchange,
# after which some templates write a later tool result otherwise (DeepSeek-R1's).
_HISTORIES: tuple[tuple[dict[str, str], ...], ...] = (
    _FIRST_TURN,
    (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 2 * 3?"},
    ),
    (
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "calculator(2 + 3)"},
        {"role": "tool", "content": "5"},
    ),
)
# Environment turns the check renders: a tool result, two tool results, a user reply.
_PROBES: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "tool", "content": "42"},),
    ({"role": "tool", "content": "6"}, {"role": "tool", "content": "7"}),
    ({"role": "user", "content": "Try again."},),
)
# Roles of environment turns: a tool result, a user reply.
ENV_ROLES = ("user", "tool")


class ChatTurnRenderer:
    """Environment messages as the model's chat template renders them after an assistant turn.

    Args:
        chat_template_kwargs (Mapping[str, Any] | None): Extra variables of the template, the
            same the prompts are rendered with.
        roles (Sequence[str]): Roles of the environment's turns: the template is checked on
            those only.

    Attributes:
        history_dependent (bool): Whether the template writes an environment turn otherwise
            after another history (DeepSeek-R1's tool outputs): `env_tokens` must then be
            given the episode's own.

    Raises:
        ValueError: If the tokenizer has no chat template, or `chat_template_problem` finds one.
    """

    def __init__(
        self,
        tokenizer: Any,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        roles: Sequence[str] = ENV_ROLES,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        problem, self.history_dependent = _check_template(
            tokenizer, self.chat_template_kwargs, roles
        )
        if problem is not None:
            raise ValueError(problem)
        # The template closes an assistant turn with a stop token, which a turn that ended on
        # one already holds (maybe another one: Llama's <|eom_id|> after a tool call).
        self._stop_texts = sorted(
            {
                tokenizer.decode([token_id], skip_special_tokens=False)
                for token_id in tokenizer.stop_tokens
            }
            - {""},
            key=len,
            reverse=True,
        )

    def env_tokens(
        self,
        messages: Sequence[Mapping[str, str]],
        closed: bool,
        history: Sequence[Mapping[str, str]] = _FIRST_TURN,
    ) -> list[int]:
        """Token ids of ``messages`` (environment turns) following an assistant turn.

        Args:
            messages (Sequence[Mapping[str, str]]): ``{"role", "content"}`` turns; the rendering
                ends with the opening of the next assistant turn.
            closed (bool): Whether the assistant turn ended with a stop token (the template's
                close is then already in the sequence).
            history (Sequence[Mapping[str, str]]): The conversation before the assistant turn,
                for templates whose environment turns depend on it.

        Returns:
            list[int]: The tokens to append (never trained).

        Raises:
            ValueError: If the template fails to render the messages.
        """
        suffix = _suffix_after_assistant(
            self.tokenizer, history, messages, self.chat_template_kwargs
        )
        if closed:
            for stop_text in self._stop_texts:
                if suffix.startswith(stop_text):
                    suffix = suffix[len(stop_text) :]
                    break
        return self.tokenizer.encode(suffix, add_bos=False, add_eos=False)


def _suffix_after_assistant(
    tokenizer: Any,
    history: Sequence[Mapping[str, str]],
    messages: Sequence[Mapping[str, str]],
    chat_template_kwargs: Mapping[str, Any],
) -> str:
    """What the template writes after an assistant turn's text, ``messages`` included."""
    conversation = [
        *({"role": m["role"], "content": m["content"]} for m in history),
        {"role": "assistant", "content": _MARKER},
        *({"role": m["role"], "content": m["content"]} for m in messages),
    ]
    text = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, **chat_template_kwargs
    )
    if text.count(_MARKER) != 1:
        roles = "/".join(m["role"] for m in messages)
        raise ValueError(
            f"the chat template of {str(tokenizer.model_dir)!r} does not keep an assistant "
            f"turn's text as it is when {roles} turns follow it"
        )
    return text[text.index(_MARKER) + len(_MARKER) :]


def chat_template_problem(
    tokenizer: Any,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    roles: Sequence[str] = ENV_ROLES,
) -> str | None:
    """Why environment turns cannot extend the sampled tokens with this template, or None.

    The template must render environment turns of the given ``roles`` after an assistant turn,
    after a short and a longer conversation, leaving the assistant turn's text as it is.

    Returns:
        str | None: One line naming the model folder and what to do, or None if it works.
    """
    return _check_template(tokenizer, dict(chat_template_kwargs or {}), roles)[0]


def _check_template(
    tokenizer: Any, kwargs: Mapping[str, Any], roles: Sequence[str]
) -> tuple[str | None, bool]:
    """`chat_template_problem`, and whether the environment's tokens depend on the history."""
    folder = str(getattr(tokenizer, "model_dir", "?"))
    if not tokenizer.chat_template:
        problem = (
            f"model folder {folder!r} has no chat template; environment turns after a chat "
            "prompt need one (or use a plain prompt template such as think_answer)"
        )
        return problem, False
    histories = [
        history
        for history in _HISTORIES
        if _of_roles(history, roles) and _renders(tokenizer, history, kwargs)
    ]
    dependent = False
    for messages in (p for p in _PROBES if all(m["role"] in roles for m in p)):
        suffixes = set()
        for history in histories or [_FIRST_TURN]:
            try:
                suffixes.add(_suffix_after_assistant(tokenizer, history, messages, kwargs))
            except ValueError as err:
                problem = (
                    f"{err}; environment turns cannot extend the sampled tokens with it: use "
                    "the family's published template (Qwen2.5, Qwen3, Llama 3.x and "
                    "DeepSeek-R1 templates work) or a plain prompt template"
                )
                return problem, False
        dependent = dependent or len(suffixes) > 1
    return None, dependent


def _of_roles(messages: Sequence[Mapping[str, str]], roles: Sequence[str]) -> bool:
    """Whether the tool results among ``messages`` are of ``roles`` (a history with a tool
    turn is no case to check an environment that never answers with one on)."""
    return all(m["role"] in roles for m in messages if m["role"] == "tool")


def _renders(
    tokenizer: Any, history: Sequence[Mapping[str, str]], kwargs: Mapping[str, Any]
) -> bool:
    """Whether the template renders ``history`` and an assistant turn at all (some refuse a
    system turn): a history it refuses is no case to check it on."""
    try:
        tokenizer.apply_chat_template(
            [*history, {"role": "assistant", "content": _MARKER}],
            add_generation_prompt=False,
            **kwargs,
        )
    except ValueError:
        return False
    return True


class PlainTurnRenderer:
    """Environment messages as plain text, for models without a chat template.

    Args:
        formats (Mapping[str, str] | None): Per role, a format with ``{content}``; by default
            tool results are ``<result>...</result>`` and user replies a line of their own.
    """

    DEFAULT_FORMATS = {"tool": "<result>{content}</result>", "user": "\n{content}\n"}

    def __init__(self, tokenizer: Any, formats: Mapping[str, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.formats = dict(formats or self.DEFAULT_FORMATS)

    def env_tokens(
        self,
        messages: Sequence[Mapping[str, str]],
        closed: bool,
        history: Sequence[Mapping[str, str]] = (),
    ) -> list[int]:
        """Token ids of ``messages``; ``closed`` and ``history`` do not matter for plain text."""
        del closed, history
        parts = []
        for message in messages:
            role = message["role"]
            if role not in self.formats:
                raise ValueError(
                    f"no plain format for {role!r} turns; formats cover {sorted(self.formats)}"
                )
            parts.append(self.formats[role].format(content=message["content"]))
        return self.tokenizer.encode("".join(parts), add_bos=False, add_eos=False)
