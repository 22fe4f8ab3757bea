"""Environments: every kind of episode, token-exact, behind one protocol (`Environment`).

The kinds and how to write one are in docs/environments.md and docs/agents.md. Importing this
package loads no torch (``grpo validate`` reads tools and environments).
"""

from grpo.envs.agent_env import AgentEnv
from grpo.envs.base import Episode, MultiTurnEnv
from grpo.envs.build import build_environment
from grpo.envs.builtin_tools import calculator, python
from grpo.envs.protocol import EngineContext, Environment, EpisodeLimits
from grpo.envs.reasoning_gym import ReasoningGymEnv
from grpo.envs.render import ChatTurnRenderer, PlainTurnRenderer, chat_template_problem
from grpo.envs.rollout import Sample, SampleRequest, episode_groups, run_episodes
from grpo.envs.runner import ToolOutcome, ToolRunner
from grpo.envs.single_turn import SingleTurnEnv
from grpo.envs.textarena_env import TextArenaEnv
from grpo.envs.tool_env import ToolEnv
from grpo.envs.tools import Tool, ToolCall, parse_tool_calls
from grpo.envs.verifiers_adapter import VerifiersEnv, verifiers_env

__all__ = [
    "AgentEnv",
    "ChatTurnRenderer",
    "EngineContext",
    "Environment",
    "Episode",
    "EpisodeLimits",
    "MultiTurnEnv",
    "PlainTurnRenderer",
    "ReasoningGymEnv",
    "Sample",
    "SingleTurnEnv",
    "SampleRequest",
    "TextArenaEnv",
    "Tool",
    "ToolCall",
    "ToolEnv",
    "ToolOutcome",
    "ToolRunner",
    "VerifiersEnv",
    "build_environment",
    "calculator",
    "chat_template_problem",
    "episode_groups",
    "parse_tool_calls",
    "python",
    "run_episodes",
    "verifiers_env",
]
