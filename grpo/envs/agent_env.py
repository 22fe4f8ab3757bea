"""Train an agent program written against an OpenAI client: the agent is the environment.

An agent is ``async def solve(client: openai.AsyncOpenAI, example: dict)`` that returns the
episode's reward (a float, rewards by name, or None for the run's reward functions). Its client
talks to the collector's engine (`grpo.envs.openai_server`), and a call that continues the
conversation continues the trajectory token-exact; anything else splits the episode into
trajectories that share its reward. Details: docs/agents.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import itertools
import logging
import math
import numbers
import queue
import re
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field

from grpo.config.options import checked_options
from grpo.config.sections import REWARD_TIMEOUT_S, RewardTimeout
from grpo.envs.base import Episode, MultiTurnEnv
from grpo.envs.dropped import failure_reason
from grpo.envs.evaluation import EPISODE_KEY
from grpo.envs.openai_server import ApiError, ChatRequest, Choice, CompletionRequest, Sampling
from grpo.envs.protocol import EngineContext, EpisodeLimits, FailedEpisodes, Prompt
from grpo.envs.rollout import Sample, Sampler, SampleRequest, TurnEngine, as_turn_engine
from grpo.observability import metric_names as names
from grpo.seeds import choice_seed, sample_seed, turn_seed

log = logging.getLogger(__name__)

AGENT_SPLITS = names.INFERENCE_AGENT_SPLITS
AGENT_OVERRIDDEN_SAMPLING = names.INFERENCE_AGENT_OVERRIDDEN_SAMPLING
AGENT_ERRORS_TEMPLATE = names.INFERENCE_AGENT_ERRORS_KIND_TEMPLATE
# Kinds of agent errors (prompt_too_long: every prompt it sent was longer than the context).
RAISED, TIMEOUT, NO_CALL, PROMPT_TOO_LONG = "raised", "timeout", "no_call", "prompt_too_long"
# The reward of an agent that returns a float.
AGENT_REWARD = "agent"
# Seconds past agent_timeout_s the engine's thread waits for an agent that blocks its loop.
_GRACE_S = 5.0

_CALL_BLOCKS = {
    "json": re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL),
    "deepseek": re.compile(r"<｜tool▁calls▁begin｜>.*?<｜tool▁calls▁end｜>", re.DOTALL),
}


def agent_problem(agent: Any) -> str | None:
    """Why ``agent`` cannot be an agent, or None: it must name (``module.function``) or be an
    ``async def`` taking ``(client, example)``."""
    if isinstance(agent, str):
        module, _, name = agent.rpartition(".")
        if not module:
            return f"expected a dotted path module.function, got {agent!r}"
        try:
            fn = getattr(importlib.import_module(module), name)
        except Exception as error:  # any import failure is the user's to see, in one line
            return f"cannot import {agent!r}: {type(error).__name__}: {error}"
    elif callable(agent):
        fn, agent = agent, getattr(agent, "__qualname__", repr(agent))
    else:
        return f"expected the dotted path of an async function, got {agent!r}"
    if not inspect.iscoroutinefunction(fn):
        return (
            f"{agent} is not an async def: an agent is "
            "`async def solve(client: openai.AsyncOpenAI, example: dict) -> float | dict | None`"
        )
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as error:
        return f"{agent} must take (client, example): {error}"
    except ValueError:  # no signature to read: trusted
        return None
    return None


def _load_agent(agent: Any) -> Callable[..., Any]:
    if (problem := agent_problem(agent)) is not None:
        raise ValueError(f"agent: {problem}")
    if callable(agent):
        return agent
    module, _, name = agent.rpartition(".")
    return getattr(importlib.import_module(module), name)


@dataclass
class _Call:
    """One call waiting for the engine's thread: its turns to sample, then their samples."""

    requests: list[SampleRequest]
    samples: list[Sample | None] = field(default_factory=list)
    error: str | None = None
    status: int = 503  # the HTTP status of ``error``: 400 for a request the engine refused
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Session:
    """One episode: its trajectories (the last one open) and where the conversation stands."""

    example: dict[str, Any]
    seed: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    segments: list[Episode] = field(default_factory=list)
    # The last call's conversation (chat), its tools, and its answers not yet in a trajectory.
    messages: list[dict[str, Any]] | None = None
    tools: Any = None
    pending: list[tuple[dict[str, Any], Sample]] = field(default_factory=list)
    calls: int = 0
    ended: str | None = None  # why the episode's limits ended it
    # Why its last call was refused for a prompt longer than the context (None: the last call
    # was answered): an agent that stops there ran out of context.
    too_long: str | None = None
    closed: bool = False  # collected: later calls are refused
    last_text: str = ""


class AgentEnv(MultiTurnEnv):
    """An agent program as the environment; its calls are the policy's turns.

    Args:
        agent (str | Callable): ``module.function``, an ``async def (client, example)``
            returning a float, rewards by name, or None.
        call_format (str): How tool calls are parsed from the sampled text into
            ``message.tool_calls``: ``json`` (Qwen), ``llama3_json`` (Llama 3.x), ``deepseek``.
        max_turns (int): Model calls per episode; the next call is HTTP 400 and the episode
            ends, ``hit_max_turns``.
        max_episode_tokens (int | None): Response tokens (sampled and bridged) of one
            trajectory; a call with no room left is HTTP 400 and ends the episode.
        agent_timeout_s (float): Seconds one episode's agent may run.
        max_concurrent_episodes (int | None): Agents running at once in this collector (None:
            every episode of a batch).
        reward_functions, reward_timeout_s: Score the last answer of an agent returning None.
        failed_episodes (str): As `MultiTurnEnv`; default ``"drop"``: an agent that raises is
            most often the program's fault, not the policy's.
        max_tokens_per_turn, stop: As `MultiTurnEnv` (``stop`` adds to each call's own).

    Raises:
        ValueError: An option out of bounds, or an agent that does not import, is not
            ``async def`` or does not take ``(client, example)``.
    """

    scored_by_reward_functions = False  # the agent returns each episode's reward

    env_roles = ("user", "tool")

    @checked_options
    def __init__(
        self,
        agent: Any = None,
        call_format: Annotated[Literal["json", "llama3_json", "deepseek"], Field()] = "json",
        max_turns: Annotated[int, Field(ge=1)] = 4,
        max_episode_tokens: Annotated[int, Field(ge=1)] | None = None,
        agent_timeout_s: Annotated[float, Field(gt=0)] = 60.0,
        max_concurrent_episodes: Annotated[int, Field(ge=1)] | None = None,
        reward_functions: Sequence[Any] = (),
        reward_timeout_s: RewardTimeout = REWARD_TIMEOUT_S,
        failed_episodes: Annotated[FailedEpisodes, Field()] = "drop",
        max_tokens_per_turn: Annotated[int, Field(ge=1)] | None = None,
        stop: Annotated[Sequence[str], Field()] = (),
    ) -> None:
        super().__init__(
            reward_functions=reward_functions,
            max_turns=max_turns,
            max_episode_tokens=max_episode_tokens,
            max_tokens_per_turn=max_tokens_per_turn,
            stop=stop,
            reward_timeout_s=reward_timeout_s,
            failed_episodes=failed_episodes,
        )
        self.agent = _load_agent(agent)
        self.call_format = call_format
        self.agent_timeout_s = agent_timeout_s
        self.max_concurrent_episodes = max_concurrent_episodes
        self.server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls: queue.Queue[_Call] = queue.Queue()
        self._put_lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._ids = itertools.count()
        self._limits: EpisodeLimits | None = None
        self._warned = False
        self._warned_names = False  # rewards under different names in one batch (`score`)
        self._counts: dict[str, float] = {}
        self._count_lock = threading.Lock()

    # ---- the collector's protocol ------------------------------------------------------------

    def prompt_ids(self, example: Mapping[str, Any]) -> list[int]:
        """Nothing: the agent's calls render their own prompts."""
        return []

    def response_budget(self, max_tokens_per_turn: int) -> int | None:
        """None: a trajectory runs until the context (or ``max_episode_tokens``)."""
        return None

    def start(self, context: EngineContext) -> None:
        """Serve the engine's endpoint and start the agents' event loop; once."""
        if self.server is not None:
            return
        self.context = context
        from grpo.envs.openai_server import OpenAIServer
        from grpo.envs.render import ChatTurnRenderer

        kwargs = getattr(context.prompt_template, "chat_template_kwargs", None)
        self.renderer = None
        if context.tokenizer.chat_template:
            try:
                self.renderer = ChatTurnRenderer(context.tokenizer, kwargs, roles=self.env_roles)
            except ValueError as error:  # chat calls are refused; completions still serve
                log.warning("AgentEnv: no chat completions on this model: %s", error)
        self._limits = self.limits(context)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="agents", daemon=True).start()
        self._slots = asyncio.Semaphore(self.max_concurrent_episodes or 2**30)
        self.server = OpenAIServer(self, max_model_len=context.max_model_len)

    def close(self) -> None:
        """Stop the endpoint and the agents' loop."""
        if self.server is not None:
            self.server.close()
            self.server = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None

    def batch_metrics(self) -> dict[str, float]:
        """Splits, overridden sampling and agent errors of the last batch, and reward
        failures."""
        with self._count_lock:
            counts, self._counts = self._counts, {}
        return {
            **super().batch_metrics(),
            AGENT_SPLITS: 0.0,
            AGENT_OVERRIDDEN_SAMPLING: 0.0,
            **counts,
        }

    def run_groups(
        self,
        prompts: Sequence[Prompt],
        engine: TurnEngine | Sampler,
        group_size: int,
        seeds: Sequence[int],
    ) -> list[list[Episode]]:
        """Run ``group_size`` agents per example; sample their calls as they come.

        Returns:
            list[list[Episode]]: Per example, its episodes' trajectories (an episode that
            split gives several, sharing its reward); a failed episode has ``error``.
        """
        if self.server is None or self._loop is None:
            raise RuntimeError("AgentEnv.start must be called before run_groups")
        engine = as_turn_engine(engine)
        groups: list[list[tuple[str, _Session, concurrent.futures.Future]]] = []
        for (example, _), seed in zip(prompts, seeds):
            group = []
            for member in range(group_size):
                name = f"ep{next(self._ids)}"
                session = _Session(dict(example), sample_seed(seed, member, 0))
                self._sessions[name] = session
                future = asyncio.run_coroutine_threadsafe(self._play(name, session), self._loop)
                group.append((name, session, future))
            groups.append(group)
        futures = [future for group in groups for *_, future in group]
        # Agents wait for a slot: the last ones start after the others' turns.
        rounds = -(-len(futures) // (self.max_concurrent_episodes or len(futures) or 1))
        deadline = time.monotonic() + (self.agent_timeout_s + _GRACE_S) * rounds
        sampling: dict[Hashable, tuple[_Call, int]] = {}
        try:
            while sampling or (not all(f.done() for f in futures) and time.monotonic() < deadline):
                self._serve(engine, sampling)
        except Exception as error:
            for call, _ in sampling.values():
                call.error = f"the engine failed: {error}"
                call.done.set()
            raise
        finally:
            with self._put_lock:  # no call joins the queue after this
                for group in groups:
                    for name, session, _ in group:
                        session.closed = True
                        # Released even when the engine failed: a collector that goes on
                        # after a failed batch would otherwise hold every session it played.
                        self._sessions.pop(name, None)
                self._refuse_queued("the batch is over")
            for future in futures:  # an agent still running has nothing left to call
                future.cancel()
        return [
            [t for name, session, future in group for t in self._finish(name, session, future)]
            for group in groups
        ]

    def score(self, episodes: Sequence[Episode]) -> list[dict[str, float]]:
        """The agents' rewards; an agent that returned None: the reward functions' on its
        last answer."""
        rewards: list[dict[str, float] | None] = [e.state.get("agent_rewards") for e in episodes]
        unscored = [e for e, r in zip(episodes, rewards) if r is None]
        scored = iter(self._score_now(unscored) if unscored else [])
        every = [dict(r) if r is not None else next(scored) for r in rewards]
        # Every episode of a batch is scored under the same names, in one order (the reference
        # actor reads them as columns): agents may return other names (a float, a dict, None
        # scored by the reward functions); a name an episode lacks scores 0 there, so each
        # episode's total reward is its own.
        names = sorted({name for reward in every for name in reward})
        if any(sorted(reward) != names for reward in every) and not self._warned_names:
            self._warned_names = True
            log.warning(
                "agents returned rewards under different names in one batch (%s); each is "
                "scored 0 where an episode lacks it, so totals are unchanged",
                ", ".join(names),
            )
        return [{name: reward.get(name, 0.0) for name in names} for reward in every]

    # ---- the engine's thread -----------------------------------------------------------------

    def _serve(self, engine: TurnEngine, sampling: dict[Hashable, tuple[_Call, int]]) -> None:
        idle = not sampling
        try:
            first = [self._calls.get(timeout=0.05 if idle else 0.0001)]
        except queue.Empty:
            first = []
        if first and idle:
            time.sleep(0.02)  # others sent at about the same time join the batch
        while True:
            try:
                first.append(self._calls.get_nowait())
            except queue.Empty:
                break
        for call in first:
            call.samples = [None] * len(call.requests)
            submitted = []
            try:
                for index, request in enumerate(call.requests):
                    key = engine.submit(request)
                    submitted.append(key)
                    sampling[key] = (call, index)
            except Exception as refused:  # the engine refused the request: that call fails
                for key in submitted:
                    sampling.pop(key, None)
                call.error = f"the engine refused the request: {type(refused).__name__}: {refused}"
                call.status = 400
                call.done.set()
        if sampling:
            for key, sample in engine.step():
                call, index = sampling.pop(key)
                call.samples[index] = sample
                if all(s is not None for s in call.samples):
                    call.done.set()

    def _refuse_queued(self, why: str) -> None:
        while True:
            try:
                call = self._calls.get_nowait()
            except queue.Empty:
                return
            call.error = why
            call.done.set()

    # ---- the agents' loop --------------------------------------------------------------------

    async def _play(self, name: str, session: _Session) -> Any:
        import openai

        async with self._slots:
            client = openai.AsyncOpenAI(
                base_url=self.server.session_url(name),
                api_key="grpo",
                max_retries=0,
                timeout=self.agent_timeout_s,
                http_client=openai.DefaultAsyncHttpxClient(trust_env=False),
            )
            try:
                return await asyncio.wait_for(
                    self.agent(client, dict(session.example)), self.agent_timeout_s
                )
            finally:
                await client.close()

    def _finish(
        self, name: str, session: _Session, future: concurrent.futures.Future
    ) -> list[Episode]:
        """The episode's trajectories, with its reward (or its error)."""
        with session.lock:
            self._commit(session)
        timed_out = f"the agent ran past agent_timeout_s={self.agent_timeout_s}"
        kind, error, result, rewards = None, None, None, None
        # A future still running when the batch ended was cancelled (`run_groups`).
        if future.cancelled():
            kind, error = TIMEOUT, timed_out
        else:
            try:
                result = future.result()
            except (asyncio.TimeoutError, TimeoutError):
                kind, error = TIMEOUT, timed_out
            except BaseException as raised:  # the agent's own failure, or a limit it hit
                if session.ended is None and session.too_long is None:
                    kind, error = RAISED, failure_reason(raised)
        segments = [s for s in session.segments if s.turn_lengths]
        if kind is None and not segments and session.too_long is not None:
            kind, error = PROMPT_TOO_LONG, session.too_long
        if kind is None and not segments:
            kind, error = NO_CALL, "the agent never called the model"
        if kind is None and session.too_long is not None:
            segments[-1].truncated = True  # it stopped where its context ran out
        if kind is None:
            try:
                rewards = _rewards(result)
            except (TypeError, ValueError) as bad:
                kind, error = RAISED, f"the agent's return value: {bad}"
        if kind is None and rewards is None and not self.reward_functions:
            if session.ended is not None or session.too_long is not None:
                rewards = {AGENT_REWARD: 0.0}  # stopped by a limit, nothing to score it with
        if kind is None and rewards is None and not self.reward_functions:
            kind = RAISED
            error = "the agent returned None and the run has no reward_functions"
        if kind is not None:
            self._count(AGENT_ERRORS_TEMPLATE.format(kind=kind))
            failed = segments or [Episode(example=session.example, prompt_ids=[], messages=[])]
            for segment in failed:
                segment.error = error
            return failed
        for segment in segments:
            segment.messages = [{"role": "assistant", "content": session.last_text}]
            segment.state[EPISODE_KEY] = name  # the trajectories of one episode (evaluation)
            if rewards is not None:
                segment.state["agent_rewards"] = rewards
        return segments

    # ---- the endpoint's backend (HTTP threads) -----------------------------------------------

    def chat(self, name: str, request: ChatRequest) -> tuple[list[int], list[Choice]]:
        """Render, continue or split the episode's trajectory, sample (`grpo.envs.openai_server`)."""
        session = self._session(name)
        context = self._started()
        with session.lock:
            self._check_open(session)
            if self.renderer is None:
                raise ApiError("the model has no chat template: use /v1/completions")
            template_messages = [_for_template(m) for m in request.messages]
            try:
                text = context.tokenizer.apply_chat_template(
                    template_messages,
                    tools=request.tools,
                    add_generation_prompt=True,
                    **self.renderer.chat_template_kwargs,
                )
            except Exception as error:  # the template's own error (raise_exception), a 400
                raise ApiError(
                    f"the chat template cannot render these messages: {_template_error(error)}"
                ) from error
            bridge = self._chat_bridge(session, request)
            if bridge is None:
                prompt = context.tokenizer.encode(text, add_bos=True, add_eos=False)
                self._new_segment(session, prompt)
            prompt_ids = self._open_turn(session, bridge)
            choices = self._sample(session, prompt_ids, request.sampling, request.read_tool_calls)
            session.messages, session.tools = list(request.messages), request.tools
            return prompt_ids, choices

    def complete(self, name: str, request: CompletionRequest) -> tuple[list[int], list[Choice]]:
        """A completion: its prompt token ids continue the trajectory when they extend it."""
        session = self._session(name)
        context = self._started()
        with session.lock:
            self._check_open(session)
            if isinstance(request.prompt, str):
                prompt = context.tokenizer.encode(request.prompt, add_bos=True, add_eos=False)
            else:
                prompt = list(request.prompt)
            bridge = None
            if session.segments:
                segment = session.segments[-1]
                held = segment.prompt_ids + segment.response_ids
                for index, (_, sample) in enumerate(session.pending or [(None, None)]):
                    sampled = held + (list(sample.token_ids) if sample is not None else [])
                    if len(prompt) > len(sampled) and prompt[: len(sampled)] == sampled:
                        bridge = (index, prompt[len(sampled) :])
                        break
            if bridge is None:
                self._new_segment(session, prompt)
            prompt_ids = self._open_turn(session, bridge)
            choices = self._sample(session, prompt_ids, request.sampling, read_tool_calls=False)
            session.messages, session.tools = None, None
            return prompt_ids, choices

    def _session(self, name: str) -> _Session:
        session = self._sessions.get(name)
        if session is None:
            raise ApiError(f"no episode {name!r} is running", 404)
        return session

    def _check_open(self, session: _Session) -> None:
        if session.closed:
            raise ApiError("the episode is over")
        if session.ended is not None:
            raise ApiError(f"the episode is over: {session.ended}")
        if session.calls >= self.max_turns:
            self._end(session, f"max_turns={self.max_turns} calls made", max_turns=True)

    def _end(self, session: _Session, why: str, max_turns: bool = False) -> None:
        session.ended = why
        self._commit(session)
        if session.segments:
            if max_turns:
                session.segments[-1].hit_max_turns = True
            else:
                session.segments[-1].truncated = True
        raise ApiError(f"the episode is over: {why}")

    def _chat_bridge(self, session: _Session, request: ChatRequest) -> tuple[int, list[int]] | None:
        """``(answer taken, bridged tokens)`` when the call continues the trajectory, else None."""
        previous = session.messages
        if previous is None or not session.pending or request.tools != session.tools:
            return None
        messages = request.messages
        if len(messages) < len(previous) + 2 or messages[: len(previous)] != previous:
            return None
        new = messages[len(previous) + 1 :]
        if any(m["role"] not in self.env_roles for m in new):
            return None
        echoed = _answer_key(messages[len(previous)])
        for index, (answer, sample) in enumerate(session.pending):
            if _answer_key(answer) == echoed:
                closed = bool(sample.token_ids) and sample.token_ids[-1] in set(
                    self._started().tokenizer.stop_tokens
                )
                history = [_for_template(m) for m in previous]
                turns = [{"role": m["role"], "content": m["content"]} for m in new]
                try:
                    tokens = self.renderer.env_tokens(turns, closed=closed, history=history)
                except ValueError:
                    return None
                return index, tokens
        return None

    def _new_segment(self, session: _Session, prompt: list[int]) -> None:
        """Start a trajectory from ``prompt``; the episode's other trajectories stay as they are.

        Raises:
            ApiError: The prompt leaves no room for a token in the context (400, as vLLM's
                server answers; the episode goes on: the agent may send a shorter one).
        """
        context_len = self._started().max_model_len
        if len(prompt) >= context_len:
            session.too_long = (
                f"prompt of {len(prompt)} tokens does not fit: the model's maximum context "
                f"length is {context_len} tokens, prompt and answer together; shorten the "
                "messages"
            )
            raise ApiError(session.too_long)
        self._commit(session)
        if session.segments:
            self._count(AGENT_SPLITS)
        session.segments.append(
            Episode(
                example=session.example, prompt_ids=list(prompt), messages=[], seed=session.seed
            )
        )

    def _commit(self, session: _Session, index: int = 0) -> None:
        """Put an answer of the last call (the one the agent took; else the first) into the
        open trajectory."""
        if session.pending and session.segments:
            answer, sample = session.pending[index]
            segment = session.segments[-1]
            segment.add_policy_turn(sample.token_ids, sample.logprobs, sample.version_runs)
            # The agent runs the tools; the calls the model made are what the run can count.
            segment.tool_calls += len(answer.get("tool_calls") or ())
        session.pending = []

    def _open_turn(self, session: _Session, bridge: tuple[int, list[int]] | None) -> list[int]:
        """Continue the open trajectory with the answer taken and the bridged tokens; the
        tokens the next turn samples after."""
        segment = session.segments[-1]
        if bridge is not None:
            index, tokens = bridge
            self._commit(session, index)
            assert self._limits is not None
            if len(tokens) >= self._limits.room(len(segment.prompt_ids), len(segment.response_ids)):
                self._end(session, "no room left in max_episode_tokens or the context")
            segment.add_env_turn(tokens)
        return segment.prompt_ids + segment.response_ids

    def _sample(
        self,
        session: _Session,
        prompt_ids: list[int],
        asked: Sampling,
        read_tool_calls: bool,
    ) -> list[Choice]:
        """Sample ``asked.n`` answers on the engine's thread; wait for them; parse their tool
        calls if ``read_tool_calls``."""
        context = self._started()
        assert self._limits is not None
        segment = session.segments[-1]
        limit = self._limits.turn_tokens(
            len(segment.prompt_ids), len(segment.response_ids), asked.max_tokens
        )
        if limit < 1:
            self._end(session, "no room left in max_episode_tokens or the context")
        self._check_sampling(asked, context)
        stop = tuple(dict.fromkeys((*asked.stop, *self.stop)))
        seed = turn_seed(session.seed, session.calls)
        requests = [
            SampleRequest(list(prompt_ids), limit, choice_seed(seed, i), stop)
            for i in range(asked.n)
        ]
        call = _Call(requests)
        with self._put_lock:
            if session.closed:
                raise ApiError("the episode is over")
            self._calls.put(call)
        if not call.done.wait(self.agent_timeout_s + _GRACE_S) or call.error is not None:
            raise ApiError(call.error or "no answer from the engine", call.status)
        session.calls += 1
        session.too_long = None
        choices = [
            self._choice(sample, read_tool_calls) for sample in call.samples if sample is not None
        ]
        session.pending = [
            (_answer_of(choice), sample) for choice, sample in zip(choices, call.samples)
        ]
        session.last_text = choices[0].content or choices[0].text
        return choices

    def _choice(self, sample: Sample, read_tool_calls: bool) -> Choice:
        from grpo.envs.tools import parse_tool_calls

        tokenizer = self._started().tokenizer
        text = tokenizer.decode(list(sample.token_ids), skip_special_tokens=True)
        calls = []
        if read_tool_calls:
            calls = [c for c in parse_tool_calls(text, self.call_format, {}) if c.error is None]
        content: str | None = text
        if calls:
            pattern = _CALL_BLOCKS.get(self.call_format)
            content = pattern.sub("", text).strip() if pattern is not None else ""
        return Choice(
            text=text,
            content=content or (None if calls else ""),
            token_ids=list(sample.token_ids),
            logprobs=list(sample.logprobs),
            finish_reason="tool_calls" if calls else sample.finish_reason,
            tool_calls=[(c.name, dict(c.arguments)) for c in calls if c.name is not None],
            token_texts=[
                tokenizer.decode([t], skip_special_tokens=False) for t in sample.token_ids
            ],
        )

    def _check_sampling(self, asked: Sampling, context: EngineContext) -> None:
        own = [
            name
            for name, value, run in (
                ("temperature", asked.temperature, context.temperature),
                ("top_p", asked.top_p, context.top_p),
            )
            if value is not None and value != run
        ]
        if asked.seed is not None:
            own.append("seed")
        if not own:
            return
        self._count(AGENT_OVERRIDDEN_SAMPLING)
        if not self._warned:
            self._warned = True
            log.warning(
                "an agent asked for its own %s; answered with the run's (temperature=%s, "
                "top_p=%s): the behaviour logprobs are the run's (counted as %s)",
                "/".join(own),
                context.temperature,
                context.top_p,
                AGENT_OVERRIDDEN_SAMPLING,
            )

    def _count(self, key: str) -> None:
        with self._count_lock:
            self._counts[key] = self._counts.get(key, 0.0) + 1.0


def _rewards(result: Any) -> dict[str, float] | None:
    """An agent's return value as rewards by name (None: score with the reward functions)."""
    if result is None:
        return None
    if isinstance(result, numbers.Real) and not isinstance(result, bool):
        result = {AGENT_REWARD: result}
    if isinstance(result, Mapping) and result:
        out = {}
        for name, value in result.items():
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise TypeError(f"reward {name!r} is a {type(value).__name__}, not a number")
            if not math.isfinite(float(value)):  # it would poison the group's advantages
                raise ValueError(f"reward {name!r} is {float(value)}, not a finite number")
            out[str(name)] = float(value)
        return out
    raise TypeError(f"expected a float, a dict of floats or None, got {type(result).__name__}")


def _template_error(error: BaseException) -> str:
    """The chat template's own error (jinja's, or its ``raise_exception``), without the
    messages the tokenizer's wrapper repeats."""
    cause = error.__cause__ or error
    return f"{type(cause).__name__}: {cause}"


def _for_template(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as chat templates read it (the tool calls' arguments as objects)."""
    return {key: value for key, value in message.items() if key != "tool_call_id"}


def _answer_of(choice: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.content or ""}
    if choice.tool_calls:
        message["tool_calls"] = [
            {"type": "function", "function": {"name": name, "arguments": arguments}}
            for name, arguments in choice.tool_calls
        ]
    return message


def _answer_key(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What must match for an echoed assistant message to be the answer given."""
    calls = tuple(
        (call["function"]["name"], repr(sorted(call["function"]["arguments"].items())))
        for call in message.get("tool_calls") or ()
        if isinstance(call.get("function", {}).get("arguments"), dict)
    )
    return message.get("role"), (message.get("content") or "").strip(), calls
