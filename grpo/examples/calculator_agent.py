"""An agent written against the ``openai`` client: it answers arithmetic with a calculator tool.

Nothing here knows about training: trained with `grpo.envs.AgentEnv` (``make demo-agent``), it
runs as it is against any OpenAI-compatible server::

    import asyncio, openai
    client = openai.AsyncOpenAI(base_url="http://localhost:8000/v1", api_key="none")
    print(asyncio.run(solve(client, {"question": "What is 37 * 48?", "answer": "1776"})))
"""

from __future__ import annotations

import json
import re
from typing import Any

from grpo.envs.builtin_tools import calculator

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression such as '37 * 48'.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
MAX_CALLS = 3
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def run_tool(arguments: str) -> str:
    """The calculator's answer to a call's JSON arguments, or the error the model reads."""
    try:
        return str(calculator(json.loads(arguments)["expression"]))
    except Exception as error:  # a malformed call is the model's mistake to learn from
        return f"error: {error}"


async def solve(client: Any, example: dict) -> float:
    """Play one question: 1.0 if the final ``<answer>`` is the example's answer, else 0.0."""
    messages: list[Any] = [{"role": "user", "content": example["question"]}]
    for _ in range(MAX_CALLS):
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR_TOOL], max_tokens=96
        )
        message = response.choices[0].message
        if not message.tool_calls:
            break
        messages.append(message)  # sent back as it came: the trajectory continues
        for call in message.tool_calls:
            result = run_tool(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = _ANSWER.search(message.content or "")
    return float(answer is not None and answer.group(1).strip() == str(example["answer"]))
