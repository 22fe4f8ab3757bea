"""The environment's turns as tokens: token in, token out.

An episode's sequence is the prompt, then the tokens the policy sampled, then the
environment's turn as the model's chat template renders it, then the policy's next sampled
tokens, and so on. Text the model wrote is never decoded and encoded again, so the trained
tokens are exactly the sampled ones, and each turn extends the tokens before it.

The environment's tokens are rendered the same way whatever came before: as the chat template
renders those messages right after an assistant turn (`ChatTurnRenderer`). The history is never
re-rendered. For a template that renders every turn the same wherever it sits (ChatML, Qwen2.5,
Llama 3), the whole sequence equals ``apply_chat_template`` of the whole conversation. For a
template that rewrites earlier turns (Qwen3 and R1 templates drop ``<think>`` from past assistant
turns), the sequence keeps what the model really saw while it sampled, earlier thinking
included. The sampler and the trainer then see the same tokens, which is what makes the
logprobs match. The rendering the template would give at inference is not what is trained.

Runs whose prompts are plain text (no chat template) use `PlainTurnRenderer`: each
environment message is a text format filled with its content. The collector picks the one that
matches the dataset's template.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_SENTINEL = "\x00grpo-assistant-turn\x00"
_ANCHOR = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}]


class ChatTurnRenderer:
    """Environment messages as the model's chat template renders them after an assistant turn.

    Args:
        tokenizer: `grpo.models.Tokenizer` with a chat template (``apply_chat_template``,
            ``encode``, ``decode``, ``stop_tokens``).

    Raises:
        ValueError: If the tokenizer has no chat template, or the template does not render an
            assistant turn followed by more turns as a continuation of that turn.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        anchored = tokenizer.apply_chat_template(_ANCHOR, add_generation_prompt=False)
        # What the template writes after an assistant message's text: usually its end-of-turn
        # token and a newline. The policy samples the end-of-turn token itself (a stop token),
        # so only the rest comes from the environment.
        self._anchored = anchored
        self._after_assistant = anchored[anchored.index(_SENTINEL) + len(_SENTINEL) :]
        self._after_stop_token = self._after_assistant
        for token_id in tokenizer.stop_tokens:
            stop_text = tokenizer.decode([token_id], skip_special_tokens=False)
            if stop_text and self._after_assistant.startswith(stop_text):
                self._after_stop_token = self._after_assistant[len(stop_text) :]
                break

    def env_tokens(self, messages: Sequence[Mapping[str, str]], closed: bool) -> list[int]:
        """Token ids of ``messages`` (environment turns) following an assistant turn.

        Args:
            messages (Sequence[Mapping[str, str]]): ``{"role", "content"}`` turns, e.g. tool
                results; the rendering ends with the opening of the next assistant turn.
            closed (bool): Whether the assistant turn ended with its stop token (``<|im_end|>``):
                the template's closing of the turn is then already in the sequence. False when
                it stopped on a stop string: the closing comes from the environment.

        Returns:
            list[int]: The tokens to append (never trained).

        Raises:
            ValueError: If the template's rendering does not extend the assistant turn.
        """
        conversation = [*_ANCHOR, *({"role": m["role"], "content": m["content"]} for m in messages)]
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
        if not text.startswith(self._anchored):
            raise ValueError(
                "the chat template renders an assistant turn differently once more turns follow "
                "it; environment turns cannot extend the sampled tokens"
            )
        suffix = text[len(self._anchored) :]
        bridge = self._after_stop_token if closed else self._after_assistant
        return self.tokenizer.encode(bridge + suffix, add_bos=False, add_eos=False)


class PlainTurnRenderer:
    """Environment messages as plain text, for models without a chat template.

    Args:
        tokenizer: `grpo.models.Tokenizer` (``encode``).
        formats (Mapping[str, str] | None): Per role, a format with ``{content}``; by default
            tool results are ``<result>...</result>`` and user replies a line of their own.

    Example:
        >>> PlainTurnRenderer(tokenizer).env_tokens([{"role": "tool", "content": "42"}], True)
        # the tokens of "<result>42</result>"
    """

    DEFAULT_FORMATS = {"tool": "<result>{content}</result>", "user": "\n{content}\n"}

    def __init__(self, tokenizer: Any, formats: Mapping[str, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.formats = dict(formats or self.DEFAULT_FORMATS)

    def env_tokens(self, messages: Sequence[Mapping[str, str]], closed: bool) -> list[int]:
        """Token ids of ``messages``; ``closed`` does not matter for plain text."""
        del closed
        parts = []
        for message in messages:
            role = message["role"]
            if role not in self.formats:
                raise ValueError(
                    f"no plain format for {role!r} turns; formats cover {sorted(self.formats)}"
                )
            parts.append(self.formats[role].format(content=message["content"]))
        return self.tokenizer.encode("".join(parts), add_bos=False, add_eos=False)
