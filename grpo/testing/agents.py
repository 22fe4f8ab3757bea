"""Agent programs for tests of `grpo.envs.AgentEnv`, written against the ``openai`` client.

Each records what its calls returned (``RECORDS``: per finished agent, the prompt token ids and
the sampled token ids of each call, as the endpoint reported them with ``return_token_ids``),
so a test can check the trained tokens against the sampled ones.
"""

from __future__ import annotations

import json
from typing import Any

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
# Per finished agent: [(prompt_token_ids, sampled token_ids), ...] of its calls, in order.
RECORDS: list[list[tuple[list[int], list[int]]]] = []
IDS = {"return_token_ids": True}


def _record(calls: list[tuple[list[int], list[int]]], response: Any) -> Any:
    calls.append((list(response.prompt_token_ids), list(response.choices[0].token_ids)))
    return response.choices[0].message


async def tool_agent(client: Any, example: dict) -> float:
    """Two chat calls with a tool: the answer (its tool calls, if any) goes back as it came,
    then a tool result; the reward is 1 if the last answer names the example's answer."""
    calls: list[tuple[list[int], list[int]]] = []
    messages: list[Any] = [{"role": "user", "content": str(example["question"])}]
    for _ in range(2):
        response = await client.chat.completions.create(
            model="anything", messages=messages, tools=[CALCULATOR], extra_body=IDS
        )
        message = _record(calls, response)
        messages.append(message)
        call_id = message.tool_calls[0].id if message.tool_calls else "call_0"
        messages.append({"role": "tool", "tool_call_id": call_id, "content": "42"})
    RECORDS.append(calls)
    return float(str(example.get("answer")) in (message.content or ""))


async def rewriting_agent(client: Any, example: dict) -> dict[str, float]:
    """Two calls, the second with a new system prompt (a rewritten history: a split)."""
    calls: list[tuple[list[int], list[int]]] = []
    question = {"role": "user", "content": str(example["question"])}
    response = await client.chat.completions.create(model="m", messages=[question], extra_body=IDS)
    _record(calls, response)
    response = await client.chat.completions.create(
        model="m",
        messages=[{"role": "system", "content": "Be brief."}, question],
        extra_body=IDS,
    )
    _record(calls, response)
    RECORDS.append(calls)
    return {"agent": 0.5}


async def completion_agent(client: Any, example: dict) -> float:
    """A completion on token ids, then one that extends it with a few tokens of its own."""
    calls: list[tuple[list[int], list[int]]] = []
    first = await client.completions.create(
        model="m", prompt=[1, 2, 3, 4], max_tokens=4, extra_body=IDS
    )
    calls.append(([1, 2, 3, 4], list(first.choices[0].token_ids)))
    prompt = [1, 2, 3, 4, *first.choices[0].token_ids, 5, 6]
    second = await client.completions.create(model="m", prompt=prompt, max_tokens=4, extra_body=IDS)
    calls.append((prompt, list(second.choices[0].token_ids)))
    RECORDS.append(calls)
    return 1.0


async def streaming_agent(client: Any, example: dict) -> float:
    """A streamed chat call with its own temperature and seed (answered with the run's)."""
    stream = await client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": str(example["question"])}],
        stream=True,
        stream_options={"include_usage": True},
        temperature=0.3,
        seed=7,
    )
    text, finish, usage = "", None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish in ("stop", "length", "tool_calls") and usage is not None
    return float(usage.completion_tokens > 0)


async def raising_agent(client: Any, example: dict) -> float:
    """Calls the model, then raises."""
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    raise RuntimeError("the agent broke")


async def idle_agent(client: Any, example: dict) -> float:
    """Never calls the model."""
    return 1.0


async def limit_agent(client: Any, example: dict) -> float:
    """Calls until the endpoint refuses (max_turns), then returns what it saw."""
    import openai

    messages: list[Any] = [{"role": "user", "content": "count"}]
    for turn in range(10):
        try:
            response = await client.chat.completions.create(model="m", messages=messages)
        except openai.BadRequestError as error:
            return float(turn) + (0.5 if "max_turns" in str(error) else 0.0)
        messages += [response.choices[0].message, {"role": "user", "content": "more"}]
    return -1.0


def sync_agent(client: Any, example: dict) -> float:
    """Not an agent: not async."""
    return json.loads("1.0")


async def one_argument_agent(client: Any) -> float:
    """Not an agent: takes no example."""
    return 1.0
