"""Environments: every kind of episode, token-exact, behind one protocol.

* `Environment` (`protocol`): what the collector calls to turn prompts into scored episodes
  (`run_groups`, `score`), and the framework's limits of an episode (`EpisodeLimits`).
  `build_environment` (`build`) makes the run's from its config.
* `SingleTurnEnv` (`single_turn`): a dataset with reward functions, one response per episode.
* `MultiTurnEnv` (`base`): the environment answers each policy turn, ends the episode, scores it.
  Its options (``max_turns``, ...) are typed and bounded in its constructor's signature
  (`options`), which the constructor and ``grpo validate`` both check values against.
* `ToolEnv` (`tool_env`): the answers are results of tools, plain Python functions with type
  hints (`tools`), run in worker processes with a timeout (`runner`); `builtin_tools` has a
  calculator and a Python interpreter.
* `verifiers_env` (`verifiers_adapter`): a verifiers environment (``verifiers.v1``), its episodes
  played against the collector's engine served on vLLM's token-in, token-out endpoint
  (`generate_server`), with the harness of `verifiers_harness` by default.
* `ReasoningGymEnv` (`reasoning_gym`): reasoning-gym's procedural tasks, its rows generated
  (training and held-out) and each response scored by the task's own scorer (the ``hub``
  extra).
* `TextArenaEnv` (`textarena_env`): a single-player TextArena game, one game object per episode,
  the policy's turns its actions and the game's own reward the episode's (the ``hub`` extra).
* `AgentEnv` (`agent_env`): an agent program written against an OpenAI client, served the
  collector's engine on OpenAI's routes (`openai_server`), token-exact, its return its reward.
* `run_episodes` (`rollout`): drives episodes on an inference engine, batched across episodes;
  `render` turns the environment's messages into tokens the way the chat template does.
* `dropped`: episodes the environment failed, scored with the failure rewards in their groups
  or dropped (`scored_episodes`), why (the exception and the lines of the environment that
  raised it), and the collector's log that names each reason once.

Importing this package loads no torch (``grpo validate`` reads tools and environments).
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
