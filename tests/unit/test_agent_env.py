"""Agents as environments: the real ``openai`` client against the endpoint, token-exact.

The fast tests play agents against a scripted engine (the endpoint, the client and the chat
template are real); the slow ones against the collector's real vLLM engine on tiny models with
the Qwen3 and Llama 3.1 templates (random weights: the structure and the tokens are checked,
not what the model says).

The tests that start a Ray cluster or a vLLM engine: tests/integration/test_agent_env.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import shutil
import types
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from grpo.envs import AgentEnv, ChatTurnRenderer, EngineContext, Sample
from grpo.envs.agent_env import AGENT_OVERRIDDEN_SAMPLING, AGENT_SPLITS
from grpo.envs.preflight import environment_problems
from grpo.envs.rollout import BatchEngine
from grpo.models import load_tokenizer
from grpo.testing import agents
from tests.helpers.chat_families import build_tiny_chat_family

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
EXAMPLE = {"question": "What is 3+4?", "answer": "7", "index": 0}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent_families")
    return {
        name: build_tiny_chat_family(root / name, family, (TEMPLATES / f"{name}.jinja").read_text())
        for name, family in (("qwen3", "qwen3"), ("llama3_1", "llama3"))
    }


class ScriptedSampler:
    """Answers the first call of an episode with a tool call, later ones with text; a call of
    3 tokens with its seed (the choices of one call then differ)."""

    def __init__(self, tokenizer, first_len: int):
        self.tokenizer = tokenizer
        self.first_len = first_len

    def __call__(self, requests):
        out = []
        for request in requests:
            text = CALL if len(request.token_ids) <= self.first_len else "the answer is 7"
            if request.max_tokens == 3:
                text = f"{request.seed % 9973} picked"
            ids = self.tokenizer.encode(text, add_bos=False, add_eos=False)
            ids.append(self.tokenizer.stop_tokens[0])
            finish = "length" if len(ids) > request.max_tokens else "stop"
            ids = ids[: request.max_tokens]
            out.append(Sample(ids, [-0.5] * len(ids), finish))
        return out


@pytest.fixture(scope="module")
def scripted(family_dirs):
    """A started AgentEnv on the Qwen3 model's tokenizer, and a scripted engine."""
    tokenizer = load_tokenizer(family_dirs["qwen3"])
    env = AgentEnv(agent=agents.tool_agent, max_turns=3, agent_timeout_s=20)
    env.start(EngineContext(str(family_dirs["qwen3"]), tokenizer, 4096, 64))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": EXAMPLE["question"]}],
        tools=[agents.CALCULATOR],
        add_generation_prompt=True,
    )
    first_len = len(tokenizer.encode(text, add_bos=True, add_eos=False))
    yield env, ScriptedSampler(tokenizer, first_len), tokenizer
    env.close()


def _play(env, sampler, agent, group_size=1):
    env.agent = agent
    agents.RECORDS.clear()
    [group] = env.run_groups([(EXAMPLE, [])], sampler, group_size, [0])
    return group, env.batch_metrics()


def _runs(trajectory_tokens, mask):
    runs: list[tuple[bool, list[int]]] = []
    for token, trained in zip(trajectory_tokens, mask):
        if runs and runs[-1][0] == trained:
            runs[-1][1].append(token)
        else:
            runs.append((bool(trained), [token]))
    return runs


def test_tool_calls_are_parsed_and_the_trajectory_continues_token_exact(scripted):
    env, sampler, tokenizer = scripted
    group, metrics = _play(env, sampler, agents.tool_agent, group_size=2)
    assert len(group) == 2 and metrics[AGENT_SPLITS] == 0
    renderer = ChatTurnRenderer(tokenizer)
    for episode, calls in zip(group, agents.RECORDS):
        assert episode.error is None and episode.state["agent_rewards"] == {"agent": 1.0}
        (prompt1, sampled1), (prompt2, sampled2) = calls
        assert tokenizer.decode(sampled1, skip_special_tokens=True) == CALL
        assert episode.prompt_ids == prompt1
        bridge = renderer.env_tokens(
            [{"role": "tool", "content": "42"}],
            closed=True,
            history=[{"role": "user", "content": EXAMPLE["question"]}],
        )
        assert prompt2 == prompt1 + sampled1 + bridge
        runs = _runs(episode.response_ids, episode.response_mask)
        assert runs == [(True, sampled1), (False, bridge), (True, sampled2)]
        # The calls the model made are counted (inference/tool_calls_per_episode).
        texts = [tokenizer.decode(s, skip_special_tokens=True) for s in (sampled1, sampled2)]
        assert episode.tool_calls == sum(CALL in text for text in texts) >= 1


def test_the_answer_has_tool_calls_as_the_client_parses_them(scripted):
    env, sampler, _ = scripted
    seen = {}

    async def agent(client, example):
        response = await client.chat.completions.create(
            model="gpt-4o",
            messages=[{"role": "user", "content": example["question"]}],
            tools=[agents.CALCULATOR],
            tool_choice="auto",
            logprobs=True,
        )
        seen["choice"] = response.choices[0]
        seen["usage"] = response.usage
        models = await client.models.list()
        seen["models"] = [m.id for m in models.data]
        return 1.0

    _play(env, sampler, agent)
    choice = seen["choice"]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "2+3"}
    assert len(choice.logprobs.content) == seen["usage"].completion_tokens
    assert seen["models"] == ["policy"]


def test_a_rewritten_history_splits_the_episode_into_trajectories_that_share_its_reward(
    scripted,
):
    env, sampler, _ = scripted
    group, metrics = _play(env, sampler, agents.rewriting_agent)
    assert metrics[AGENT_SPLITS] == 1
    [calls] = agents.RECORDS
    assert [e.prompt_ids for e in group] == [calls[0][0], calls[1][0]]
    assert [e.response_ids for e in group] == [calls[0][1], calls[1][1]]
    assert all(all(e.response_mask) for e in group)
    assert env.score(group) == [{"agent": 0.5}, {"agent": 0.5}]


def test_completions_on_token_ids_continue_the_trajectory(scripted):
    env, sampler, _ = scripted
    [episode], metrics = _play(env, sampler, agents.completion_agent)
    assert metrics[AGENT_SPLITS] == 0
    (prompt1, sampled1), (_, sampled2) = agents.RECORDS[0]
    assert len(sampled1) == len(sampled2) == 4  # max_tokens
    assert episode.prompt_ids == prompt1
    assert _runs(episode.response_ids, episode.response_mask) == [
        (True, sampled1),
        (False, [5, 6]),
        (True, sampled2),
    ]


def test_streaming_and_the_runs_sampling_wins(scripted, caplog):
    env, sampler, _ = scripted
    [episode], metrics = _play(env, sampler, agents.streaming_agent)
    assert episode.error is None and episode.state["agent_rewards"] == {"agent": 1.0}
    assert metrics[AGENT_OVERRIDDEN_SAMPLING] == 1


def test_an_agent_that_raises_or_never_calls_is_an_episode_with_an_error(scripted):
    env, sampler, _ = scripted
    [episode], metrics = _play(env, sampler, agents.raising_agent)
    assert "RuntimeError: the agent broke" in episode.error
    assert metrics["inference/agent_errors_raised"] == 1
    [episode], metrics = _play(env, sampler, agents.idle_agent)
    assert episode.error == "the agent never called the model"
    assert metrics["inference/agent_errors_no_call"] == 1


def test_a_call_past_max_turns_is_refused_and_the_episode_ends_flagged(scripted):
    env, sampler, _ = scripted
    [episode], _ = _play(env, sampler, agents.limit_agent)
    assert episode.error is None and episode.hit_max_turns
    assert episode.state["agent_rewards"] == {"agent": 3.5}  # 3 calls, then "max_turns"
    assert len(episode.turn_lengths) == 3


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "the body is not JSON"),
        (b'{"messages": []}', "messages must be a non-empty list"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', "messages[0].role"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}', "max_tokens"),
    ],
)
def test_a_malformed_body_is_http_400_with_the_reason(scripted, body, reason):
    env, _, _ = scripted
    request = urllib.request.Request(
        env.server.session_url("nobody") + "/chat/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=5)
    assert raised.value.code == 400
    assert reason in json.loads(raised.value.read())["error"]["message"]


@pytest.mark.parametrize(
    ("agent", "words"),
    [
        ("grpo.testing.agents.no_such_agent", "cannot import"),
        ("no_such_module.solve", "cannot import"),
        ("grpo.testing.agents.sync_agent", "is not an async def"),
        ("grpo.testing.agents.one_argument_agent", "must take (client, example)"),
    ],
)
def test_validate_refuses_a_bad_agent_in_one_line(agent, words):
    node = {"_component_": "grpo.envs.AgentEnv", "agent": agent}
    [problem] = environment_problems("environment", node)
    assert problem.startswith("environment.agent: ") and words in problem
    assert "\n" not in problem
    good = {**node, "agent": "grpo.testing.agents.tool_agent"}
    assert environment_problems("environment", good) == []


# ---- the real engine -----------------------------------------------------------------------


def test_an_agent_past_its_timeout_is_an_episode_with_an_error(scripted):
    env, sampler, _ = scripted

    async def slow(client, example):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        await asyncio.sleep(30)

    env.agent_timeout_s = 0.5
    try:
        [episode], metrics = _play(env, sampler, slow)
    finally:
        env.agent_timeout_s = 20
    assert "agent_timeout_s" in episode.error
    assert metrics["inference/agent_errors_timeout"] == 1


def test_with_n_answers_the_one_sent_back_continues_the_trajectory(scripted):
    env, sampler, tokenizer = scripted
    seen = {}

    async def agent(client, example):
        messages = [{"role": "user", "content": example["question"]}]
        first = await client.chat.completions.create(
            model="m", messages=messages, n=2, max_tokens=3, extra_body=agents.IDS
        )
        seen["first"] = [list(choice.token_ids) for choice in first.choices]
        messages += [first.choices[1].message, {"role": "user", "content": "go on"}]
        second = await client.chat.completions.create(
            model="m", messages=messages, extra_body=agents.IDS
        )
        seen["prompt"] = list(second.prompt_token_ids)
        return 1.0

    [episode], metrics = _play(env, sampler, agent)
    assert len(seen["first"]) == 2 and seen["first"][0] != seen["first"][1]
    assert metrics[AGENT_SPLITS] == 0
    runs = _runs(episode.response_ids, episode.response_mask)
    assert runs[0] == (True, seen["first"][1])
    assert seen["prompt"] == episode.prompt_ids + seen["first"][1] + runs[1][1]


def test_a_batch_of_clients_connecting_at_once_are_all_answered():
    """A generation batch's episodes open their connections at the same moment: each of 128
    fresh `openai` clients (no retries, as agents get them) is answered, none reset."""
    import asyncio

    import openai

    from grpo.envs.openai_server import OpenAIServer

    server = OpenAIServer(backend=None, max_model_len=64)

    async def one(index: int) -> str:
        client = openai.AsyncOpenAI(
            base_url=server.session_url(f"episode-{index}"),
            api_key="grpo",
            max_retries=0,
            timeout=30,
            http_client=openai.DefaultAsyncHttpxClient(trust_env=False),
        )
        async with client:
            return (await client.models.list()).data[0].id

    async def all_at_once() -> list[str]:
        return await asyncio.gather(*(one(index) for index in range(128)))

    try:
        assert asyncio.run(all_at_once()) == ["policy"] * 128
    finally:
        server.close()


@pytest.mark.parametrize("length", ["-1", "many", str(10**12)])
def test_a_content_length_that_is_no_size_is_http_400_and_the_connection_closes(length):
    """A negative length would read until the client hangs up: the client would wait forever."""
    import http.client

    from grpo.envs.openai_server import OpenAIServer

    server = OpenAIServer(backend=None)
    try:
        host, port = server.base_url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=5)
        connection.putrequest("POST", "/s/episode-0/v1/chat/completions")
        connection.putheader("Content-Length", length)
        connection.endheaders()
        response = connection.getresponse()
        assert response.status == 400
        assert "Content-Length" in json.loads(response.read())["error"]["message"]
        assert response.getheader("Connection") == "close"
    finally:
        server.close()


def test_agent_rewards_are_finite_numbers_by_name():
    import numpy as np

    from grpo.envs.agent_env import _rewards

    assert _rewards(np.float32(0.5)) == {"agent": 0.5}
    assert _rewards({"b": 1, "a": np.int64(2)}) == {"b": 1.0, "a": 2.0}
    assert _rewards(None) is None
    for bad in (float("nan"), {"a": float("inf")}):
        with pytest.raises(ValueError, match="not a finite number"):
            _rewards(bad)
    with pytest.raises(TypeError, match="not a number"):
        _rewards({"a": "1"})


def test_a_batch_whose_agents_return_other_reward_names_is_scored_under_one_set(scripted):
    """The reference actor reads a batch's rewards as columns: a float from one agent, a dict
    from another, in any order, all come back under the same names, each total unchanged."""
    from grpo.envs.base import Episode

    env, _, _ = scripted
    episodes = []
    for rewards in ({"agent": 1.0}, {"z": 2.0, "a": 0.5}, {"a": 1.0, "z": 0.0}):
        episode = Episode(example={"answer": "1"}, prompt_ids=[1], messages=[])
        episode.state["agent_rewards"] = rewards
        episodes.append(episode)
    scored = env.score(episodes)
    assert [list(reward) for reward in scored] == [["a", "agent", "z"]] * 3
    assert [sum(reward.values()) for reward in scored] == [1.0, 2.5, 1.0]


async def _refused_then_answered_agent(client, example: dict) -> float:
    """Its first request is one the engine refuses (a 400 for it alone), its second is not."""
    import openai

    messages = [{"role": "user", "content": example["question"]}]
    try:
        await client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    except openai.BadRequestError as refused:
        assert "the engine refused the request" in str(refused)
    else:
        raise AssertionError("the refused request was answered")
    response = await client.chat.completions.create(model="m", messages=messages)
    return float(len(response.choices) == 1)  # answered


def test_a_request_the_engine_refuses_fails_that_call_not_the_batch(scripted):
    """vLLM refuses some requests when they are submitted (a token id past the vocabulary):
    the agent gets a 400 for that call, the other episodes of the batch go on."""
    env, sampler, _ = scripted

    class RefusingEngine(BatchEngine):
        def submit(self, request):
            if request.max_tokens == 2:
                raise ValueError("token id out of vocabulary")
            return super().submit(request)

    env.agent = _refused_then_answered_agent
    groups = env.run_groups([(EXAMPLE, []), (EXAMPLE, [])], RefusingEngine(sampler), 2, [0, 1])
    episodes = [episode for group in groups for episode in group]
    assert len(episodes) == 4
    assert [(e.error, e.state.get("agent_rewards")) for e in episodes] == [
        (None, {"agent": 1.0})
    ] * 4


def test_evaluation_counts_an_episode_split_in_two_once(scripted):
    """A rewritten history splits an episode into two trajectories that share its reward: held
    out, it is one sample of its example, not two (avg@k and pass@k count episodes)."""
    from grpo.envs.evaluation import evaluation_episodes

    env, sampler, _ = scripted
    env.agent = agents.rewriting_agent
    env.batch_metrics()  # counts since the last batch: those of this test only
    [result] = evaluation_episodes(env, sampler, [EXAMPLE], [[]], 2, seed=0)
    assert len(result["samples"]) == 2
    assert all(sample["rewards"] == {"agent": 0.5} for sample in result["samples"])
    assert env.batch_metrics()[AGENT_SPLITS] == 2


# ---- tool_choice, seeds, failures and limits -----------------------------------------------


class Recorder:
    """A sampler that keeps each request and what was sampled for it, in order."""

    def __init__(self, sample):
        self.sample = sample
        self.calls: list[tuple] = []

    def __call__(self, requests):
        samples = self.sample(requests)
        self.calls.extend(zip(requests, samples))
        return samples


def test_tool_choice_none_reads_no_calls_and_one_that_needs_constrained_sampling_is_refused(
    scripted,
):
    """vLLM enforces ``required`` and a named function by constraining sampling; the run
    samples the policy as it is, so they are a 400 that says so, never ignored. ``none``
    renders the tools as ``auto`` does and returns the answer as text."""
    import openai

    env, sampler, tokenizer = scripted
    seen = {}

    async def agent(client, example):
        messages = [{"role": "user", "content": example["question"]}]
        for choice in ("required", {"type": "function", "function": {"name": "calculator"}}):
            try:
                await client.chat.completions.create(
                    model="m", messages=messages, tools=[agents.CALCULATOR], tool_choice=choice
                )
            except openai.BadRequestError as refused:
                seen[json.dumps(choice)] = str(refused)
        response = await client.chat.completions.create(
            model="m",
            messages=messages,
            tools=[agents.CALCULATOR],
            tool_choice="none",
            extra_body=agents.IDS,
        )
        seen["none"] = response
        return 1.0

    [episode], _ = _play(env, sampler, agent)
    assert episode.error is None and len(episode.turn_lengths) == 1
    for choice in ('"required"', '{"type": "function", "function": {"name": "calculator"}}'):
        assert (
            f"tool_choice {choice} is not supported: it needs constrained sampling" in seen[choice]
        )
    response = seen["none"]
    with_tools = tokenizer.apply_chat_template(
        [{"role": "user", "content": EXAMPLE["question"]}], tools=[agents.CALCULATOR]
    )
    assert response.prompt_token_ids == tokenizer.encode(with_tools, add_bos=True, add_eos=False)
    [choice] = response.choices
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content == CALL  # the scripted call, as text


def test_every_answer_of_an_episode_samples_with_a_seed_of_its_own(scripted):
    """Two requests with one seed and the same tokens sample the same continuation: every
    answer of every call of a group's episodes has its own seed (answer 1 of the first call
    is not the second call's seed)."""
    env, sampler, _ = scripted
    recorder = Recorder(sampler)

    async def agent(client, example):
        messages = [{"role": "user", "content": example["question"]}]
        for _ in range(3):
            response = await client.chat.completions.create(
                model="m", messages=messages, n=3, max_tokens=3
            )
            messages += [response.choices[0].message, {"role": "user", "content": "again"}]
        return 1.0

    group, _ = _play(env, recorder, agent, group_size=2)
    assert [e.error for e in group] == [None, None]
    seeds = [request.seed for request, _ in recorder.calls]
    assert len(seeds) == 2 * 3 * 3 and len(set(seeds)) == len(seeds)


def test_a_batch_whose_engine_fails_releases_its_episodes(scripted):
    """The engine raising ends the batch with its error; the episodes' sessions go with it
    (none is held for the collector's life), and the next batch plays."""
    env, sampler, _ = scripted
    urls = []

    class DyingEngine(BatchEngine):
        def step(self):
            raise RuntimeError("the engine died")

    async def agent(client, example):
        urls.append(str(client.base_url))
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        return 1.0

    env.agent = agent
    with pytest.raises(RuntimeError, match="the engine died"):
        env.run_groups([(EXAMPLE, [])], DyingEngine(sampler), 2, [0])
    assert len(urls) == 2 and env._sessions == {}
    request = urllib.request.Request(
        urls[0] + "chat/completions",
        data=json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=5)
    assert raised.value.code == 404  # the episode is gone, not merely closed
    [episode], _ = _play(env, sampler, agents.tool_agent)
    assert episode.error is None


def test_messages_the_chat_template_refuses_are_a_400_naming_its_error(family_dirs):
    """Llama 3.1's template refuses parallel tool calls (raise_exception): the agent gets a
    400 that says so, without the conversation echoed back, and its next call is answered."""
    import openai

    tokenizer = load_tokenizer(family_dirs["llama3_1"])
    seen = {}

    async def agent(client, example):
        call = {"type": "function", "function": {"name": "calculator", "arguments": "{}"}}
        parallel = [
            {"role": "user", "content": example["question"]},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{**call, "id": "a"}, {**call, "id": "b"}],
            },
            {"role": "tool", "tool_call_id": "a", "content": "1"},
        ]
        try:
            await client.chat.completions.create(model="m", messages=parallel)
        except openai.BadRequestError as refused:
            seen["status"], seen["message"] = refused.status_code, refused.body["message"]
        response = await client.chat.completions.create(model="m", messages=parallel[:1])
        return float(bool(response.choices))

    env = AgentEnv(agent=agent, max_turns=3, agent_timeout_s=20)
    env.start(EngineContext(str(family_dirs["llama3_1"]), tokenizer, 4096, 64))
    try:
        group = env.run_groups([(EXAMPLE, [])], ScriptedSampler(tokenizer, 0), 2, [0])[0]
    finally:
        env.close()
    assert seen["status"] == 400
    assert seen["message"] == (
        "the chat template cannot render these messages: TemplateError: This model only "
        "supports single tool-calls at once!"
    )
    assert [(e.error, e.state["agent_rewards"]) for e in group] == [(None, {"agent": 1.0})] * 2


def _too_long_agent(refusals: list[str], retry: bool):
    """An agent whose first prompt is longer than the context; it keeps the endpoint's reason
    and, with ``retry``, then sends a short prompt."""
    import openai

    async def agent(client, example):
        try:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "7 " * 3000}]
            )
        except openai.BadRequestError as refused:
            refusals.append(refused.body["message"])
        if retry:
            short = [{"role": "user", "content": example["question"]}]
            await client.chat.completions.create(model="m", messages=short)
        return 1.0

    return agent


async def _split_too_long_agent(client, example):
    """One call answered, then a rewritten history too long for the context; it gives up."""
    question = {"role": "user", "content": example["question"]}
    await client.chat.completions.create(model="m", messages=[question])
    await client.chat.completions.create(
        model="m", messages=[{"role": "system", "content": "7 " * 3000}, question]
    )


def test_a_prompt_longer_than_the_context_is_a_400_the_agent_sees_not_a_missing_call(scripted):
    """The agent is told the prompt does not fit (as vLLM's server tells it) and may send a
    shorter one; an episode that never fits is its own kind of error, and one that stops where
    its context ran out is flagged truncated."""
    env, sampler, _ = scripted
    refusals: list[str] = []
    [episode], metrics = _play(env, sampler, _too_long_agent(refusals, retry=False))
    [refused] = refusals
    assert re.fullmatch(
        r"prompt of \d+ tokens does not fit: the model's maximum context length is 4096 "
        r"tokens, prompt and answer together; shorten the messages",
        refused,
    )
    assert episode.error == refused
    assert metrics["inference/agent_errors_prompt_too_long"] == 1
    assert "inference/agent_errors_no_call" not in metrics

    [episode], metrics = _play(env, sampler, _too_long_agent(refusals, retry=True))
    assert len(refusals) == 2 and episode.error is None and not episode.truncated
    assert len(episode.turn_lengths) == 1 and episode.state["agent_rewards"] == {"agent": 1.0}

    [episode], metrics = _play(env, sampler, _split_too_long_agent)
    assert episode.error is None and episode.truncated and len(episode.turn_lengths) == 1
    assert episode.state["agent_rewards"] == {"agent": 0.0}  # stopped by a limit
    assert metrics[AGENT_SPLITS] == 0


class Versioned:
    """Tags each sample with the policy versions that sampled its tokens: ``updates[i]`` is
    how many tokens of the i-th request the old weights sampled before new ones took over
    (None: all of them), the version counting up from ``first``."""

    def __init__(self, sample, first: int, updates: list[int | None]):
        self.sample, self.version, self.updates = sample, first, list(updates)

    def __call__(self, requests):
        out = []
        for sample in self.sample(requests):
            old = self.updates.pop(0)
            if old is None or old >= len(sample.token_ids):
                runs = ((self.version, len(sample.token_ids)),)
            else:
                runs = ((self.version, old), (self.version + 1, len(sample.token_ids) - old))
                self.version += 1
            out.append(sample._replace(version_runs=runs))
        return out


def test_each_trained_token_keeps_the_policy_version_that_sampled_it(scripted):
    """Weights change while an agent's episode runs: its first call is sampled under version 3
    and the second from its third token on under version 4. The trajectory records each
    token's own version (the environment's tokens between the calls have none), and its
    oldest and newest versions are 3 and 4."""
    from grpo.envs.rollout import episode_groups

    env, sampler, _ = scripted
    recorder = Recorder(Versioned(sampler, first=3, updates=[None, 2]))
    [episode], _ = _play(env, recorder, agents.tool_agent)
    (_, first), (_, second) = recorder.calls
    assert episode.version_runs == [(3, len(first.token_ids) + 2), (4, len(second.token_ids) - 2)]
    per_token = [version for version, count in episode.version_runs for _ in range(count)]
    assert len(per_token) == sum(episode.response_mask)  # one version per trained token
    trained = [t for t, m in zip(episode.response_ids, episode.response_mask) if m]
    assert trained == [*first.token_ids, *second.token_ids]
    [group] = episode_groups(
        [[episode]], [{"agent": 1.0}], group_ids=[0], sequence_id=lambda: "s0", policy_version=0
    )
    [trajectory] = group.trajectories
    assert (trajectory.policy_version, trajectory.last_policy_version) == (3, 4)


# ---- agents in other languages and frameworks ----------------------------------------------


class ToolThenAnswer:
    """Answers with a calculator call until the conversation holds a tool result (Qwen3's
    template writes it in <tool_response>), then with the answer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, requests):
        out = []
        for request in requests:
            seen = self.tokenizer.decode(request.token_ids, skip_special_tokens=False)
            text = "the answer is 7" if "<tool_response>" in seen else CALL
            ids = [*self.tokenizer.encode(text, add_bos=False, add_eos=False)]
            ids.append(self.tokenizer.stop_tokens[0])
            out.append(Sample(ids, [-0.25] * len(ids), "stop"))
        return out


def _example_module(path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _docs_module(name: str) -> types.ModuleType:
    """The ``# NAME.py`` python block of docs/agents.md, as a module: the page's own code."""
    page = (REPO / "docs" / "agents.md").read_text()
    [body] = re.findall(rf"```python\n(# {name}\.py\n.*?)```", page, flags=re.DOTALL)
    module = types.ModuleType(name)
    exec(compile(body, f"docs/agents.md ({name}.py)", "exec"), module.__dict__)
    return module


def _assert_trained_as_sampled(episode, recorded) -> list[list[int]]:
    """The episode is one trajectory: the first call's prompt, then each call's sampled tokens
    (trained, with their logprobs) and between them the tokens the next call's prompt added
    (masked). Returns those added tokens."""
    (first, _), *_ = recorded
    assert episode.prompt_ids == list(first.token_ids)
    expected, held, bridges = [], list(first.token_ids), []
    for index, (request, sample) in enumerate(recorded):
        if index:
            assert request.token_ids[: len(held)] == held  # the call extends the trajectory
            bridges.append(list(request.token_ids[len(held) :]))
            expected.append((False, bridges[-1]))
        expected.append((True, list(sample.token_ids)))
        held = list(request.token_ids) + list(sample.token_ids)
    assert _runs(episode.response_ids, episode.response_mask) == expected
    trained = [lp for lp, m in zip(episode.logprobs, episode.response_mask) if m]
    assert trained == [lp for _, sample in recorded for lp in sample.logprobs]
    return bridges


@pytest.mark.skipif(
    not all(shutil.which(program) for program in ("bash", "curl", "jq")),
    reason="the shipped example agent needs bash, curl and jq",
)
def test_a_program_in_another_language_trains_on_the_tokens_it_sampled(scripted):
    """examples/agents/curl_agent.sh, started per episode by examples/agents/subprocess_agent.py
    with OPENAI_BASE_URL: its two calls are one trajectory, the answer it sends back as the
    endpoint gave it, the tokens trained those sampled."""
    env, sampler, tokenizer = scripted
    solve = _example_module(REPO / "examples" / "agents" / "subprocess_agent.py").solve
    recorder = Recorder(sampler)
    [episode], metrics = _play(env, recorder, solve)
    assert episode.error is None and metrics[AGENT_SPLITS] == 0
    [bridge] = _assert_trained_as_sampled(episode, recorder.calls)
    assert "final answer only" in tokenizer.decode(bridge, skip_special_tokens=False)
    # What the program printed is the second answer's text: the reward is read from it.
    answer = tokenizer.decode(recorder.calls[1][1].token_ids, skip_special_tokens=True)
    assert episode.state["agent_rewards"] == {"agent": float("7" in answer)}


def test_the_langgraph_agent_of_the_docs_trains_on_the_tokens_it_sampled(scripted):
    """The LangGraph agent of docs/agents.md (ChatOpenAI on the episode's base_url, a tool
    node): its tool call, the tool's result and its answer are one trajectory, trained as
    sampled."""
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    env, _, tokenizer = scripted
    solve = _docs_module("langgraph_agent").solve
    recorder = Recorder(ToolThenAnswer(tokenizer))
    [episode], metrics = _play(env, recorder, solve)
    assert episode.error is None and metrics[AGENT_SPLITS] == 0
    assert episode.state["agent_rewards"] == {"agent": 1.0}
    [bridge] = _assert_trained_as_sampled(episode, recorder.calls)
    assert "<tool_response>\n5\n</tool_response>" in tokenizer.decode(bridge)
