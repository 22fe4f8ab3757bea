"""A verifiers harness that runs the chat and tool loop in the collector's own process.

verifiers' own harnesses launch an agent program (installed with ``uv``, or in containers);
this loop asks the model through the episode's interception endpoint (so verifiers records every
call in the trace, token-exact) and calls the task's tools on their MCP servers. The default
harness of ``grpo.envs.verifiers_env``.
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from typing import Any

import verifiers.v1 as vf
from openai import APIStatusError, AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp

__all__ = ["ChatHarness", "ChatHarnessConfig"]


class ChatHarnessConfig(vf.HarnessConfig):
    """Options of `ChatHarness`."""

    max_turns: int = 8
    """Model turns per episode; the episode ends after this many even if a tool was called."""


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """The chat loop, in process: model turn, tool calls on the task's MCP servers, repeat."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def setup(self, runtime: Any) -> None:
        """Nothing to install: the loop runs here."""

    async def launch(
        self,
        ctx: Any,
        trace: Any,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: Any,
        tool_interception_url: str | None = None,
    ) -> Any:
        """Run the episode's turns against ``endpoint``; the trace records them."""
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages.extend(message_to_wire(message) for message in prompt)
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            async with AsyncExitStack() as stack:
                tools: list[dict[str, Any]] = []
                dispatch: dict[str, Any] = {}
                servers: dict[str, Any] = {}
                if mcp_urls:
                    spec = {
                        "mcpServers": {
                            name: {"url": url, "timeout": self.config.tool_timeout}
                            for name, url in mcp_urls.items()
                        }
                    }
                    tools, dispatch, servers = await connect_mcp(spec, stack)
                for _ in range(self.config.max_turns):
                    request: dict[str, Any] = {"model": ctx.model, "messages": messages}
                    if tools:
                        request["tools"] = tools
                    try:
                        completion = await client.chat.completions.create(**request)
                    except APIStatusError as error:
                        if trace.stop_condition is not None:  # a limit of the env ended it
                            break
                        return vf.ProgramResult(exit_code=1, stdout="", stderr=str(error))
                    message = completion.choices[0].message
                    messages.append(message.model_dump(exclude_none=True))
                    if not message.tool_calls:
                        break
                    for call in message.tool_calls:
                        content = await _call_tool(call, dispatch, servers)
                        messages.append(
                            {
                                "role": "tool",
                                "tool_call_id": call.id,
                                "name": call.function.name,
                                "content": content,
                            }
                        )
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


async def _call_tool(call: Any, dispatch: dict[str, Any], servers: dict[str, Any]) -> str:
    """The tool's result, or an error line the model reads (unknown tool, bad JSON)."""
    name = call.function.name
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as error:
        return f"error: the arguments of {name} are not JSON: {error}"
    if name not in dispatch:
        return f"error: no tool named {name!r}"
    return await call_mcp(servers, dispatch, name, arguments)
