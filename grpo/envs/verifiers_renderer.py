"""The renderer a verifiers client uses here: each turn extends the tokens sampled before it.

verifiers' client asks its renderer to *bridge* each later turn: extend the previous prompt and
sampled ids with the environment's new messages. ``renderers``' ``DefaultRenderer`` never can,
so the client re-renders the conversation, and wherever that differs from what was sampled the
trace splits and the turns before the split are not trained. `TemplateBridgeRenderer` bridges
with `grpo.envs.render.ChatTurnRenderer`, the tokens our own multi-turn episodes append.
"""

from __future__ import annotations

import logging
from typing import Any

from renderers import CustomRendererConfig, DefaultRenderer, DefaultRendererConfig, RenderedTokens
from renderers.base import extract_message_tool_names, reject_assistant_in_extension

from grpo.envs.render import ChatTurnRenderer

log = logging.getLogger(__name__)


def bridge_renderer_config(tool_parser: str, **chat_template_kwargs: Any) -> CustomRendererConfig:
    """The ``renderers`` config that selects `TemplateBridgeRenderer` for a verifiers client."""
    return CustomRendererConfig(
        import_path=f"{__name__}.{TemplateBridgeRenderer.__name__}",
        tool_parser=tool_parser,
        **chat_template_kwargs,
    )


class TemplateBridgeRenderer(DefaultRenderer):
    """``DefaultRenderer`` whose bridge extends the sampled ids with the environment's turns.

    A chat template that `grpo.envs.render.chat_template_problem` refuses gets no bridge (logged
    once): the client re-renders every turn as ``DefaultRenderer`` does.
    """

    config_class = DefaultRendererConfig

    def __init__(self, tokenizer: Any, config: DefaultRendererConfig | None = None) -> None:
        super().__init__(tokenizer, config)
        from grpo.models.tokenizer import load_tokenizer

        self._turns: ChatTurnRenderer | None = None
        try:
            # grpo's tokenizer of the same folder: its stop ids are the ones the engine stops
            # on (generation_config.json), which decide whether a turn is already closed.
            self._turns = ChatTurnRenderer(
                load_tokenizer(tokenizer.name_or_path), dict(self.config.model_extra or {})
            )
        except (OSError, ValueError) as error:
            log.warning(
                "verifiers: every turn is rendered again from its messages (a trace splits "
                "where that differs from the sampled tokens): %s",
                error,
            )

    def bridge_to_next_turn(
        self,
        previous_prompt_ids: list[int],
        previous_completion_ids: list[int],
        new_messages: list[Any],
        *,
        tools: list[Any] | None = None,
    ) -> RenderedTokens | None:
        """The next prompt: the previous prompt and sampled ids, then ``new_messages``' tokens.

        Returns:
            RenderedTokens | None: ``token_ids`` starting with ``previous_prompt_ids +
            previous_completion_ids``, or None (the client then re-renders) when there is
            nothing to extend, ``new_messages`` holds an assistant turn or non-text content, or
            the template cannot be bridged.
        """
        del tools
        # A template whose environment turns depend on the conversation before them
        # (DeepSeek-R1's tool outputs) cannot be bridged from ids alone: the bridge is given
        # no messages of the history.
        if (
            self._turns is None
            or self._turns.history_dependent
            or not previous_prompt_ids
            or not previous_completion_ids
            or not new_messages
            or reject_assistant_in_extension(new_messages)
        ):
            return None
        turns = []
        for message in new_messages:
            content = message.get("content")
            if content is None:
                content = ""
            if not isinstance(content, str):  # content parts (images): the template's own path
                return None
            turns.append({"role": str(message.get("role")), "content": content})
        # Closed: the sampled turn ended on a stop token, which is the template's own close
        # of an assistant turn; otherwise (a stop string, a length cut) the close is added.
        closed = previous_completion_ids[-1] in self._turns.tokenizer.stop_tokens
        try:
            env_ids = self._turns.env_tokens(turns, closed)
        except ValueError as error:
            log.warning("verifiers: no bridge for %s turns: %s", [t["role"] for t in turns], error)
            return None
        previous = [*previous_prompt_ids, *previous_completion_ids]
        # One block attributed to no single message: verifiers keeps it, masked, with the next
        # sampled turn.
        return RenderedTokens(
            token_ids=[*previous, *env_ids],
            message_indices=[-1] * (len(previous) + len(env_ids)),
            sampled_mask=[False] * (len(previous) + len(env_ids)),
            message_roles=[turn["role"] for turn in turns],
            message_tool_names=extract_message_tool_names(new_messages),
        )
