"""Train on a verifiers environment (``verifiers.v1``), with the exact tokens its episodes sampled.

The environment's client asks the collector's engine for completions on vLLM's token-in,
token-out endpoint (`grpo.envs.generate_server`). A finished episode's trace becomes one
trajectory whose sampled tokens are trained and everything else masked; its sampled tokens are
checked against what the engine returned, and a trace that differs is dropped, never trained.
Where verifiers splits a trace, the last branch is trained (docs/environments.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import importlib.util
import itertools
import logging
import os
import sys
import threading
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from grpo.config.sections import REWARD_TIMEOUT_S
from grpo.envs.base import Episode
from grpo.envs.dropped import cause_first, failure_reason, last_frame
from grpo.envs.protocol import EngineContext, Environment, EpisodeLimits, Prompt
from grpo.envs.rollout import Sample, Sampler, SampleRequest, TurnEngine, as_turn_engine
from grpo.observability import metric_names as names
from grpo.seeds import mix_seed

log = logging.getLogger(__name__)

INSTALL_HINT = 'pip install -e ".[verifiers]"'
DEFAULT_HARNESS = "grpo.envs.verifiers_harness"
# Tasks read from a taskset at most: a procedural one may never end, and the driver and every
# collector read it when they build the environment.
DEFAULT_MAX_TASKS = 10_000
# Keys of harness_args that would set how turns are sampled, which the collector owns.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "sampling")


def verifiers_problems(key: str, node: Mapping[str, Any]) -> list[str]:
    """What is wrong with a ``grpo.envs.verifiers_env`` node, without loading the environment.

    Returns:
        list[str]: Each problem as ``key: what is wrong``.
    """
    if importlib.util.find_spec("verifiers") is None:
        return [f"{key}: the verifiers extra is not installed; run: {INSTALL_HINT}"]
    problems = []
    for name, default in (("taskset", None), ("harness", DEFAULT_HARNESS)):
        module = node.get(name, default)
        if not isinstance(module, str) or not module:
            problems.append(f"{key}.{name}: expected the name of a module, got {module!r}")
        elif (problem := _module_problem(module)) is not None:
            problems.append(f"{key}.{name}: {problem}")
        elif name == "taskset" and (problem := _seat_problem(module)) is not None:
            problems.append(f"{key}.taskset: {problem}")
    for name, default in (
        ("max_turns", 8),
        ("max_tasks", DEFAULT_MAX_TASKS),
        ("max_concurrent_episodes", 1),
    ):
        value = node.get(name, default)
        if value is None and name == "max_concurrent_episodes":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{key}.{name}: expected an int >= 1, got {value!r}")
    harness_args = node.get("harness_args") or {}
    for name in (
        n for n in SAMPLING_KEYS if isinstance(harness_args, Mapping) and n in harness_args
    ):
        problems.append(
            f"{key}.harness_args.{name}: the collector's engine samples every turn with "
            "inference.temperature and inference.top_p (the logprobs trained against are "
            "those); set them there"
        )
    # The parsers renderers has (verifiers' client parses tool calls with them).
    from renderers.parsers import TOOL_PARSERS

    tool_parser = node.get("tool_parser", "qwen3")
    if tool_parser not in TOOL_PARSERS:
        problems.append(
            f"{key}.tool_parser: {tool_parser!r} is not one of {', '.join(TOOL_PARSERS)}"
        )
    return problems


def _seat(taskset: str) -> str:
    """The seat the policy plays in the taskset's verifiers environment.

    verifiers plays a taskset with the ``Env`` class its module exports, else with its
    ``SingleAgentEnv``. Imports the taskset's module.

    Raises:
        ValueError: If that environment has more than one seat (or none), or its seat
            samples with its own temperature or top-p.
    """
    import verifiers.v1 as vf
    from verifiers.v1.utils.loaders import environment_class

    env_class = environment_class(_plugin_id(taskset))
    config_type = vf.env_config_type(_plugin_id(taskset))
    seats = [
        name
        for name, field in config_type.model_fields.items()
        if isinstance(field.default, vf.AgentConfig)
        or (isinstance(field.annotation, type) and issubclass(field.annotation, vf.AgentConfig))
    ]
    if len(seats) != 1:
        raise ValueError(
            f"{taskset} exports its own verifiers Env, {env_class.__name__}, with "
            f"{len(seats)} seats ({', '.join(seats) or 'none'}); grpo.envs.verifiers_env "
            "trains the one seat of a single-agent environment: export a Taskset alone, or "
            "an Env with one AgentConfig seat"
        )
    sampling = getattr(config_type.model_fields[seats[0]].default, "sampling", None)
    own = sorted({"temperature", "top_p"} & (sampling.model_fields_set if sampling else set()))
    if own:
        raise ValueError(
            f"{taskset} exports its own verifiers Env, {env_class.__name__}, whose "
            f"{seats[0]} seat samples with its own {' and '.join(own)}; the collector's "
            "engine samples every turn with inference.temperature and inference.top_p: "
            "set them there and leave the seat's sampling unset"
        )
    return seats[0]


def _seat_problem(taskset: str) -> str | None:
    """Why the policy cannot play the taskset's environment (`_seat`), or None."""
    try:
        _seat(taskset)
    except ValueError as error:
        return str(error)
    except Exception as error:  # the module or its Env fails to load: say how
        return f"cannot load {taskset!r}: {type(error).__name__}: {error}"
    return None


def _module_problem(module: str) -> str | None:
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as error:
        return f"cannot import {module!r}: {error}"
    if found is None:
        return (
            f"no module named {module!r} is installed (a verifiers environment is a "
            "module whose __all__ names its Taskset or Harness)"
        )
    return None


def verifiers_env(
    taskset: str,
    *,
    harness: str = DEFAULT_HARNESS,
    max_turns: int = 8,
    tool_parser: str = "qwen3",
    taskset_args: Mapping[str, Any] | None = None,
    harness_args: Mapping[str, Any] | None = None,
    episode_timeout_s: float = 600.0,
    max_tasks: int = DEFAULT_MAX_TASKS,
    max_concurrent_episodes: int | None = None,
    reward_functions: Sequence[Any] = (),
    reward_timeout_s: float = REWARD_TIMEOUT_S,
) -> VerifiersEnv:
    """A verifiers environment to train on (the ``_component_`` of an ``environment:`` node).

    Args:
        taskset (str): Module of the taskset (its ``__all__`` names one ``vf.Taskset``).
        harness (str): Module of the harness; the default runs the chat and tool loop in the
            collector's process (`grpo.envs.verifiers_harness`).
        tool_parser (str): A ``renderers.parsers`` parser that finds tool calls in sampled
            tokens (``qwen3`` reads Hermes ``<tool_call>`` blocks).
        harness_args (Mapping | None): More fields of the harness's config; not its sampling,
            which the collector owns.
        episode_timeout_s (float): How long a group of episodes may take.
        max_tasks (int): Most rows read from the taskset (a procedural one may never end).
        max_concurrent_episodes (int | None): Most episodes of this worker in flight at once
            (None: every episode of a batch); it bounds how many task tool servers run.
        reward_functions, reward_timeout_s: Ignored: the taskset's rewards score its episodes.

    Raises:
        ValueError: If the extra is missing or an argument is wrong (the message names it).
    """
    del reward_functions, reward_timeout_s  # the taskset scores its own episodes
    problems = verifiers_problems(
        "verifiers_env",
        {
            "taskset": taskset,
            "harness": harness,
            "max_turns": max_turns,
            "max_tasks": max_tasks,
            "max_concurrent_episodes": max_concurrent_episodes,
            "tool_parser": tool_parser,
            "harness_args": harness_args,
        },
    )
    if problems:
        raise ValueError(problems[0])
    return VerifiersEnv(
        taskset,
        harness=harness,
        max_turns=max_turns,
        tool_parser=tool_parser,
        taskset_args=dict(taskset_args or {}),
        harness_args=dict(harness_args or {}),
        episode_timeout_s=episode_timeout_s,
        max_tasks=max_tasks,
        max_concurrent_episodes=max_concurrent_episodes,
    )


class VerifiersEnv(Environment):
    """A loaded verifiers environment that plays its episodes against the collector's engine.

    Build it with `verifiers_env`. Its `examples` are the taskset's rows and its `prompt_ids`
    are empty (the client renders its own prompts).
    """

    brings_tasks = True  # the taskset's rows are the data; no held-out split here
    scored_by_reward_functions = False  # the taskset's rubric scores its episodes

    def __init__(
        self,
        taskset: str,
        *,
        harness: str,
        max_turns: int,
        tool_parser: str,
        taskset_args: dict[str, Any],
        harness_args: dict[str, Any],
        episode_timeout_s: float,
        max_tasks: int = DEFAULT_MAX_TASKS,
        max_concurrent_episodes: int | None = None,
    ) -> None:
        import verifiers.v1 as vf

        self.taskset = taskset
        self.max_turns = max_turns
        self.tool_parser = tool_parser
        self.episode_timeout_s = episode_timeout_s
        harness_config = {"id": _plugin_id(harness), **harness_args}
        # verifiers caps the turns of every harness (the seat's max_turns); a harness whose
        # own config counts turns too (grpo.envs.verifiers_harness) gets the same number.
        if "max_turns" in vf.harness_config_type(harness_config["id"]).model_fields:
            harness_config.setdefault("max_turns", max_turns)
        # The config of the taskset's own Env class if it exports one (else SingleAgentEnv's).
        config = vf.resolve_env_config(
            {
                "taskset": {"id": _plugin_id(taskset), **taskset_args},
                _seat(taskset): {
                    "harness": harness_config,
                    # Local processes only: verifiers' default runtime is a remote sandbox.
                    "runtime": {"type": "subprocess"},
                    "max_turns": max_turns,
                },
            }
        )
        self.env = vf.load_environment(config)
        # Read lazily and at most max_tasks: a procedural taskset may never end, and reading it
        # whole would hold the driver while its memory grows.
        self.tasks = list(itertools.islice(iter(self.env.taskset), max_tasks))
        if not self.tasks:
            raise ValueError(f"verifiers_env: taskset {taskset!r} has no tasks")
        if len(self.tasks) == max_tasks:
            log.info("verifiers_env: read the first %d tasks of %r (max_tasks)", max_tasks, taskset)
        # Task-scoped tool servers start anew for every episode: say so, it is what a batch costs.
        own_servers = type(self.env.taskset).task_type().toolsets(self.env.taskset.config.task)
        if own_servers:
            log.info(
                "verifiers_env: every episode of %r starts %d tool server(s) of its own "
                "(Task.toolsets; Taskset.toolsets serve one per worker); max_concurrent_episodes=%s",
                taskset,
                len(own_servers),
                max_concurrent_episodes,
            )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._serving: concurrent.futures.Future | None = None
        self._stop_serving: asyncio.Event | None = None
        self._server: Any = None
        self._context: Any = None
        # Per episode (the client's session id), what the engine sampled for it, in order.
        self._sampled: dict[str, list[Sample]] = {}
        self._seeds = itertools.count()
        self.split_traces = 0
        self.max_concurrent_episodes = max_concurrent_episodes
        # Held by an episode for the whole of it, its tool servers included (verifiers'
        # run_slot); one for the worker, across groups and batches.
        self._episode_slots = (
            asyncio.Semaphore(max_concurrent_episodes) if max_concurrent_episodes else None
        )

    def examples(self) -> list[dict[str, Any]]:
        """The taskset's rows as dataset examples (``index``, ``question``, ``answer``)."""
        rows = []
        for index, task in enumerate(self.tasks):
            data = task.data
            prompt = data.prompt
            question = prompt if isinstance(prompt, str) else _messages_text(prompt)
            rows.append(
                {
                    "index": index,
                    "question": question,
                    "prompt": question,
                    "answer": str(getattr(data, "answer", "") or ""),
                }
            )
        return rows

    def response_budget(self, max_tokens_per_turn: int) -> int | None:
        """None: an episode runs until the engine's context (or its taskset's own end)."""
        return None

    def prompt_ids(self, example: Mapping[str, Any]) -> list[int]:
        """Nothing: the environment's client renders its prompts itself."""
        return []

    def start(self, context: EngineContext) -> None:
        """Serve the engine's endpoint and open the environment (tool servers); once."""
        if self._loop is not None:
            return
        super().start(context)
        import verifiers.v1 as vf

        from grpo.envs.generate_server import GenerateServer
        from grpo.envs.verifiers_renderer import bridge_renderer_config

        # The client loads the tokenizer from the model folder; never from the hub.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self._server = GenerateServer(max_model_len=context.max_model_len)
        self._context = vf.ModelContext(
            model=self._server.model_name,
            client=vf.TrainClientConfig(
                base_url=f"{self._server.base_url}/v1",
                # A variable of its own: the default (PRIME_API_KEY) reads a user config file.
                api_key_var="GRPO_VERIFIERS_API_KEY",
                # Each turn extends the tokens sampled before it (a trace splits only where
                # the environment rewrote its conversation), not a re-render of the messages.
                renderer=bridge_renderer_config(self.tool_parser),
                renderer_model_name=str(context.model_dir),
            ),
            sampling=vf.SamplingConfig(
                temperature=context.temperature,
                top_p=context.top_p,
                max_tokens=context.max_tokens_per_turn,
            ),
        )
        self._loop = _event_loop()
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._serving = asyncio.run_coroutine_threadsafe(self._hold_serving(ready), self._loop)
        ready.result(timeout=120)

    async def _hold_serving(self, ready: concurrent.futures.Future) -> None:
        """Keep ``env.serving()`` (interception server, tool servers) open in one task."""
        self._stop_serving = asyncio.Event()
        try:
            async with self.env.serving():
                ready.set_result(True)
                await self._stop_serving.wait()
        except BaseException as error:
            if not ready.done():
                ready.set_exception(error)
            raise

    def close(self) -> None:
        """Close the environment's servers and the endpoint."""
        if self._loop is None:
            return
        loop, self._loop = self._loop, None
        loop.call_soon_threadsafe(self._stop_serving.set)
        try:
            self._serving.result(timeout=60)
        except Exception as error:  # closing: say it, do not raise over the caller's error
            log.warning("verifiers environment did not close cleanly: %s", error)
        self._server.close()

    def batch_metrics(self) -> dict[str, float]:
        """``inference/episode_split_traces``: traces of the last batch split by the template."""
        return {names.INFERENCE_EPISODE_SPLIT_TRACES: float(self.split_traces)}

    def run_groups(
        self,
        prompts: Sequence[Prompt],
        engine: TurnEngine | Sampler,
        group_size: int,
        seeds: Sequence[int],
    ) -> list[list[Episode]]:
        """Run ``group_size`` episodes of each example's task to their end.

        Args:
            seeds (Sequence[int]): One per prompt; request ``n`` of the batch samples with
                ``mix_seed(seeds[0], n)``.

        Returns:
            list[list[Episode]]: Per example, its episodes; one whose trace failed or whose
            tokens differ from what the engine sampled has ``error`` set.
        """
        if self._loop is None:
            raise RuntimeError("VerifiersEnv.start must be called before run_groups")
        context = self._started()
        # The framework's limits: the client's max_tokens within one turn's, within the context.
        limits = EpisodeLimits(
            max_turns=self.max_turns,
            max_tokens_per_turn=context.max_tokens_per_turn,
            max_model_len=self._server.max_model_len,
        )
        examples = [example for example, _ in prompts]
        seed = seeds[0]
        engine = as_turn_engine(engine)
        self.split_traces = 0  # traces of this call split by the template
        groups = [
            asyncio.run_coroutine_threadsafe(
                self._play(self.tasks[int(example["index"])], group_size), self._loop
            )
            for example in examples
        ]
        # Hashed, not consecutive: consecutive seeds would run into the next batch's.
        seeds = (mix_seed(seed, n) for n in itertools.count())
        sampling: dict[Hashable, Any] = {}  # engine key -> the request it answers
        try:
            while any(not group.done() for group in groups):
                # Wait for requests only while the engine has nothing to do.
                idle = not sampling
                requests = self._server.take(
                    timeout_s=0.05 if idle else 0.0, gather_s=0.02 if idle else 0.0
                )
                for request in requests:
                    if (limit := self._turn_limit(request, limits)) is not None:
                        turn = SampleRequest(
                            list(request.token_ids), limit, next(seeds), request.stop
                        )
                        sampling[engine.submit(turn)] = request
                if sampling:
                    for key, result in engine.step():
                        request = sampling.pop(key)
                        if request.session is not None:
                            self._sampled.setdefault(request.session, []).append(result)
                        self._server.answer(request, result)
        except Exception as error:
            self._server.fail(list(sampling.values()), f"engine failed: {error}")
            raise
        return [
            self._group_episodes(example, group, group_size)
            for example, group in zip(examples, groups)
        ]

    async def _play(self, task: Any, group_size: int) -> list[Any]:
        slots = self.env.slots(task, group_size)
        return await asyncio.wait_for(
            asyncio.gather(
                *(self.env.run_slot(slot, self._context, self._episode_slots) for slot in slots),
                return_exceptions=True,
            ),
            timeout=self.episode_timeout_s,
        )

    def _turn_limit(self, request: Any, limits: EpisodeLimits) -> int | None:
        """Tokens ``request`` may sample, or None (answered with an error) if none fit."""
        limit = limits.turn_tokens(len(request.token_ids), 0, request.max_tokens or None)
        if limit < 1:
            self._server.fail(
                [request],
                f"a prompt of {len(request.token_ids)} tokens leaves no room in "
                f"max_model_len={self._server.max_model_len}",
                status=400,
            )
            return None
        return limit

    def _group_episodes(
        self, example: Mapping[str, Any], group: concurrent.futures.Future, group_size: int
    ) -> list[Episode]:
        try:
            outcomes = group.result()
        except Exception as error:  # the group timed out or the environment failed
            outcomes = [error] * group_size
        return [self._episode(example, outcome) for outcome in outcomes]

    def _episode(self, example: Mapping[str, Any], outcome: Any) -> Episode:
        """A finished verifiers episode as an `Episode` (token-exact), or one with ``error``."""
        episode = Episode(example=dict(example), prompt_ids=[], messages=[])
        if isinstance(outcome, BaseException):
            episode.error = failure_reason(outcome)
            return episode
        trace = outcome.traces[-1] if outcome.traces else None
        sampled = self._sampled.pop(trace.id, []) if trace is not None else []
        if trace is None or not trace.ok:
            errors = [*(trace.errors if trace else ()), *outcome.errors]
            # Kept whole: a tool server's message ends with the traceback that names the cause,
            # so each error leads with its last line and the frame it raised in.
            detail = "; ".join(
                cause_first(
                    f"{e.type}: {e.message}",
                    name=e.type,
                    where=last_frame(e.traceback) if e.traceback else None,
                )
                for e in errors
            )
            stop = trace.stop_condition if trace else None
            episode.error = f"the episode failed ({stop}): {detail or 'no detail'}"
            return episode
        branches = [branch for branch in trace.branches if branch.trainable]
        if not branches:
            episode.error = "the trace has no trainable branch"
            return episode
        if len(branches) > 1:
            self.split_traces += 1
        branch = branches[-1]
        problem = _fill_from_branch(episode, branch.token_ids, branch.sampled_mask, sampled)
        if problem is not None:
            episode.error = problem
            return episode
        episode.messages = [{"role": "assistant", "content": trace.last_reply}]
        episode.tool_calls = sum(1 for node in branch.nodes if node.message.role == "tool")
        episode.truncated = bool(trace.is_truncated) and trace.stop_condition != "max_turns"
        episode.hit_max_turns = trace.stop_condition == "max_turns"
        # Weighted, by name; a reward that did not run (None) scores 0.
        episode.state["rewards"] = {
            name: 0.0 if reward is None else float(reward.value)
            for name, reward in sorted(trace.rewards.items())
        } or {"reward": float(trace.reward)}
        episode.state["metrics"] = {
            name: float(value) for name, value in trace.metrics.items() if value is not None
        }
        return episode

    def score(self, episodes: Sequence[Episode]) -> list[dict[str, float]]:
        """The taskset's rewards of each episode, by name, weighted as the taskset weights
        them (they add up to the trace's ``reward``)."""
        return [dict(episode.state["rewards"]) for episode in episodes]


def _fill_from_branch(
    episode: Episode, token_ids: list[int], sampled_mask: list[bool], sampled: list[Sample]
) -> str | None:
    """Split a branch into prompt and turns, checking its sampled runs against the engine's.

    Returns:
        str | None: Why the branch cannot be trained as it stands, or None.
    """
    if True not in sampled_mask:
        return "the trace sampled no token"
    first = sampled_mask.index(True)
    runs: list[tuple[bool, list[int]]] = []
    for token, is_sampled in zip(token_ids[first:], sampled_mask[first:]):
        if runs and runs[-1][0] == is_sampled:
            runs[-1][1].append(token)
        else:
            runs.append((is_sampled, [token]))
    policy_runs = [tokens for is_sampled, tokens in runs if is_sampled]
    # The trained turns are the last ones the engine sampled for this episode (a split trace
    # trains its final branch, whose earlier turns are context).
    engine_turns = [turn for turn in sampled if turn.token_ids][-len(policy_runs) :]
    if [list(t.token_ids) for t in engine_turns] != policy_runs:
        return (
            "the trace's sampled tokens differ from the tokens the engine sampled for it "
            f"({sum(map(len, policy_runs))} vs {sum(len(t.token_ids) for t in engine_turns)} "
            "tokens)"
        )
    episode.prompt_ids = list(token_ids[:first])
    turns = iter(engine_turns)
    for is_sampled, tokens in runs:
        if is_sampled:
            turn = next(turns)
            episode.add_policy_turn(turn.token_ids, turn.logprobs, turn.version_runs)
        else:
            episode.add_env_turn(tokens)
    return None


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """The process's one event loop for verifiers, running in a daemon thread.

    One for every environment of the process: verifiers keeps process-wide state (its
    renderer pool's locks) bound to the loop that first used it.
    """
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="verifiers", daemon=True).start()
        return _LOOP


def _plugin_id(module: str) -> str:
    """A verifiers plugin id for ``module``.

    verifiers 0.4.0 looks a plugin id up as ``verifiers.v1.<group>.<id>`` first, which fails on
    a dotted id (``my_package.my_taskset``) before it tries the id itself; the module is
    imported here and registered under a flat alias that it finds.
    """
    if "." not in module and module == module.lower():
        return module
    alias = "grpo_plugin__" + module.replace(".", "__").lower()
    sys.modules.setdefault(alias, importlib.import_module(module))
    return alias


def _messages_text(messages: Any) -> str:
    """A chat prompt's text, for tables and logs."""
    parts = []
    for message in messages or ():
        content = message.get("content") if isinstance(message, Mapping) else message.content
        parts.append(content if isinstance(content, str) else str(content))
    return "\n".join(parts)
