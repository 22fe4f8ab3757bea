"""Tools that misbehave on purpose, and scripted multi-turn environments, for tests and drills
(in the package because worker processes import tools by name)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from grpo.envs.base import Episode, Message, MultiTurnEnv


def hang(seconds: float) -> str:
    """Sleep for the given seconds (a tool that hangs)."""
    time.sleep(seconds)
    return "woke up"


async def nap(seconds: float) -> str:
    """Sleep for the given seconds without blocking, then say so (an async tool)."""
    await asyncio.sleep(seconds)
    return f"napped {seconds} s"


def crash(code: int) -> str:
    """Kill the worker process with the given exit code (a tool that crashes)."""
    os._exit(code)


def allocate(megabytes: int) -> str:
    """Hold the given megabytes of memory for a moment (a tool that needs memory)."""
    block = bytearray(megabytes * 2**20)
    return f"held {len(block) // 2**20} MB"


def fail(message: str) -> str:
    """Raise a ValueError with the given message (a tool that raises)."""
    raise ValueError(message)


class EchoUserEnv(MultiTurnEnv):
    """A user who answers every assistant turn with ``"again"`` until ``max_turns``.

    Any policy, an untrained one too, then exercises the whole multi-turn path.
    ``raise_on_turn`` makes the environment raise at that turn of the episodes of examples with
    an even ``index``.
    """

    def __init__(self, raise_on_turn: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.raise_on_turn = raise_on_turn

    def env_response(
        self, messages: list[Message], state: dict[str, Any], episode: Episode
    ) -> list[Message] | None:
        if episode.num_turns == self.raise_on_turn and episode.example.get("index", 1) % 2 == 0:
            raise RuntimeError(f"scripted failure at turn {episode.num_turns}")
        return [{"role": "user", "content": "again"}]


class MisspeltStateEnv(MultiTurnEnv):
    """A user who checks each answer against ``state["anwser"]``, a key `reset` never sets.

    Every episode that reaches the environment raises ``KeyError: 'anwser'``: an environment
    with a typo, as a run meets it.
    """

    def env_response(
        self, messages: list[Message], state: dict[str, Any], episode: Episode
    ) -> list[Message] | None:
        if messages[-1]["content"].strip() == state["anwser"]:
            return None
        return [{"role": "user", "content": "try again"}]
