"""An agent in another language: one subprocess per episode, given the episode's endpoint.

`grpo.envs.AgentEnv` runs ``solve`` once per episode. It starts ``curl_agent.sh`` (bash, curl
and jq) with ``OPENAI_BASE_URL`` set to the episode's session URL, and scores what the program
prints. The program's calls are sampled and trained like those of a Python agent: the endpoint
ties them to the episode by the session in the URL, whatever the client.

To train it, put this folder on ``PYTHONPATH`` and name it in the config:

    environment:
      _component_: grpo.envs.AgentEnv
      agent: subprocess_agent.solve
      agent_timeout_s: 60
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

PROGRAM = Path(__file__).with_name("curl_agent.sh")


async def solve(client: Any, example: dict) -> float:
    """Run the program on the row's question; reward 1 if its answer names the row's answer.

    Args:
        client (openai.AsyncOpenAI): The episode's client; only its ``base_url`` is used.
        example (dict): The dataset row (``question``, ``answer``).

    Returns:
        float: 1.0 if the program's answer contains the row's answer, else 0.0.

    Raises:
        RuntimeError: The program failed (its status and the end of its stderr): the episode
            is one with an error (counted, and dropped by default: ``failed_episodes``).
    """
    env = {
        **os.environ,
        "OPENAI_BASE_URL": str(client.base_url).rstrip("/"),
        "OPENAI_API_KEY": "grpo",
        # The endpoint is on 127.0.0.1: a proxy set in the environment must not carry its calls.
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    process = await asyncio.create_subprocess_exec(
        "bash",
        str(PROGRAM),
        str(example["question"]),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await process.communicate()
    except asyncio.CancelledError:  # agent_timeout_s: the program must not outlive its episode
        process.kill()
        await process.wait()
        raise
    if process.returncode != 0:
        raise RuntimeError(f"{PROGRAM.name} exited {process.returncode}: {err.decode()[-500:]}")
    return float(str(example["answer"]) in out.decode())
