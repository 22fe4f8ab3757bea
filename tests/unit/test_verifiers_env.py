"""verifiers environments: the endpoint, token-exact episodes, and what is refused.

The episodes here are real verifiers episodes (``verifiers.v1``: its loader, interception server,
client and renderer, and an MCP tool server in a process of its own) against a scripted engine
behind `grpo.envs.generate_server.GenerateServer`, so the tokens each turn samples are known.
Whole runs with vLLM are in ``test_verifiers_runs.py``.
"""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request

import pytest

pytest.importorskip("verifiers", reason="the verifiers extra: pip install -e '.[verifiers]'")

from grpo.envs import EngineContext, verifiers_env  # noqa: E402
from grpo.envs.generate_server import GENERATE_PATH, GenerateServer  # noqa: E402
from grpo.envs.rollout import Sample  # noqa: E402
from grpo.envs.verifiers_adapter import _fill_from_branch, verifiers_problems  # noqa: E402
from grpo.testing.tiny_models import build_tiny_qwen2  # noqa: E402

ARITHMETIC = "grpo.testing.verifiers_arithmetic"
ADD_TOOL = "grpo.testing.verifiers_add_tool"


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    """A tiny Qwen2 folder whose tokenizer has Qwen2.5's tool tokens and template."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("tool_model") / "model", tool_calls=True)


@pytest.fixture(scope="module")
def tokenizer(tool_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tool_model_dir))


class ScriptedEngine:
    """Answers like a model that knows sums: with the ``add`` tool when it is offered.

    ``compact_calls`` writes the call's JSON without spaces, which the chat template then
    writes back with spaces (an earlier turn rewritten by the template).
    """

    def __init__(self, tokenizer, wrong: bool = False, compact_calls: bool = False) -> None:
        self.tokenizer = tokenizer
        self.wrong = wrong
        self.compact_calls = compact_calls
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.samples: list[list[int]] = []
        self.prompts: list[list[int]] = []

    def reply(self, text: str) -> str:
        a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", text)[-1])
        last_user = text.rsplit("<|im_start|>user", 1)[-1]
        if "<tool_response>" in last_user:
            result = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", last_user)[-1]
            return f"The answer is {result}."
        if "<tools>" in text:
            separators = (",", ":") if self.compact_calls else (", ", ": ")
            call = json.dumps({"name": "add", "arguments": {"a": a, "b": b}}, separators=separators)
            return f"<tool_call>\n{call}\n</tool_call>"
        return str(a + b + (1 if self.wrong else 0))

    def __call__(self, requests):
        samples = []
        for request in requests:
            self.prompts.append(list(request.token_ids))
            ids = self.tokenizer.encode(self.reply(self.tokenizer.decode(request.token_ids)))
            ids = [*ids, self.end][: request.max_tokens]
            self.samples.append(ids)
            logprobs = [-0.25 - 0.01 * i for i in range(len(ids))]
            samples.append(Sample(ids, logprobs, "stop"))
        return samples


def run_groups(model_dir, taskset, engine, *, group_size=2, rows=2, **env_args):
    env = verifiers_env(taskset, max_turns=3, **env_args)
    context = EngineContext(
        model_dir=str(model_dir),
        tokenizer=None,  # the client renders with its own
        max_model_len=1024,
        max_tokens_per_turn=64,
    )
    env.start(context)
    try:
        examples = env.examples()[:rows]
        prompts = [(example, env.prompt_ids(example)) for example in examples]
        seeds = [0] * len(prompts)
        return env, examples, env.run_groups(prompts, engine, group_size, seeds)
    finally:
        env.close()


# ---------------------------------------------------------------------------- the endpoint


def _post(url: str, body: object) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_generate_server_speaks_the_token_in_token_out_protocol():
    server = GenerateServer(model_name="policy", max_model_len=333)
    try:
        replies: dict[int, tuple[int, dict]] = {}
        bodies = [
            {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "stop": ["x"]}},
            {"token_ids": [9], "sampling_params": {"temperature": 0}},
        ]
        threads = [
            threading.Thread(
                target=lambda i=i, b=b: replies.__setitem__(
                    i, _post(server.base_url + GENERATE_PATH, b)
                )
            )
            for i, b in enumerate(bodies)
        ]
        for thread in threads:
            thread.start()
        requests = []
        while len(requests) < 2:
            requests += server.take(timeout_s=10.0)
        requests.sort(key=lambda r: len(r.token_ids), reverse=True)
        assert [r.token_ids for r in requests] == [[5, 6, 7], [9]]
        assert (requests[0].max_tokens, requests[0].stop, requests[0].greedy) == (4, ("x",), False)
        assert (requests[1].max_tokens, requests[1].greedy) == (None, True)
        server.answer(requests[0], Sample([11, 12], [-0.5, -1.5], "length"))
        server.answer(requests[1], Sample([13], [-0.25], "stop"))
        for thread in threads:
            thread.join(30)

        status, body = replies[0]
        assert status == 200
        [choice] = body["choices"]
        assert choice["token_ids"] == [11, 12] and choice["finish_reason"] == "length"
        assert [
            (c["token"], c["token_id"], c["logprob"]) for c in choice["logprobs"]["content"]
        ] == [
            ("token_id:11", 11, -0.5),
            ("token_id:12", 12, -1.5),
        ]
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        assert replies[1][1]["choices"][0]["token_ids"] == [13]

        with urllib.request.urlopen(server.base_url + "/v1/models", timeout=30) as response:
            [model] = json.loads(response.read())["data"]
        assert (model["id"], model["max_model_len"]) == ("policy", 333)
        status, body = _post(server.base_url + GENERATE_PATH, {"token_ids": []})
        assert status == 400 and "token_ids" in body["error"]
        status, body = _post(
            server.base_url + GENERATE_PATH, {"token_ids": [1], "sampling_params": {"n": 4}}
        )
        assert status == 400 and "sampling_params.n must be 1" in body["error"]
        status, body = _post(server.base_url + "/v1/completions", {"token_ids": [1]})
        assert status == 404 and GENERATE_PATH in body["error"]
    finally:
        server.close()


# ---------------------------------------------------------------------------- episodes


def test_single_turn_episodes_are_the_sampled_tokens_after_the_rendered_prompt(
    tool_model_dir, tokenizer
):
    engine = ScriptedEngine(tokenizer)
    env, examples, groups = run_groups(tool_model_dir, ARITHMETIC, engine)
    assert [len(group) for group in groups] == [2, 2]
    for example, group in zip(examples, groups):
        for episode in group:
            assert episode.error is None
            conversation = [{"role": "user", "content": example["question"]}]
            prompt = tokenizer.encode(
                tokenizer.apply_chat_template(
                    conversation, tokenize=False, add_generation_prompt=True
                )
            )
            assert episode.prompt_ids == prompt
            assert episode.response_ids == tokenizer.encode(example["answer"]) + [
                tokenizer.convert_tokens_to_ids("<|im_end|>")
            ]
            assert all(episode.response_mask) and episode.num_turns == 1
            assert episode.logprobs == pytest.approx(
                [-0.25 - 0.01 * i for i in range(len(episode.response_ids))]
            )
    # Each reward by name, weighted as the taskset weights it; the metric apart.
    assert env.score([e for g in groups for e in g]) == [{"brief": 0.5, "correct": 1.0}] * 4
    assert [e.state["metrics"] for g in groups for e in g] == [{"reply_chars": 1.0}] * 4

    wrong = ScriptedEngine(tokenizer, wrong=True)
    env, _, groups = run_groups(tool_model_dir, ARITHMETIC, wrong, rows=1, group_size=1)
    assert env.score(groups[0]) == [{"brief": 0.5, "correct": 0.0}]


def test_tool_episode_trains_the_calls_and_masks_the_tool_results(tool_model_dir, tokenizer):
    engine = ScriptedEngine(tokenizer)
    env, examples, groups = run_groups(tool_model_dir, ADD_TOOL, engine, rows=1)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for episode in groups[0]:
        assert episode.error is None, episode.error
        assert (episode.num_turns, episode.tool_calls) == (2, 1)
        call = tokenizer.encode(engine.reply("<tools> What is 2 + 3?")) + [im_end]
        answer = tokenizer.encode("The answer is 5.") + [im_end]
        tool_turn = tokenizer.encode(
            "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        # Exactly: the sampled call, the template's tool turn (masked), the sampled answer.
        assert episode.response_ids == call + tool_turn + answer
        assert episode.response_mask == [True] * len(call) + [False] * len(tool_turn) + [
            True
        ] * len(answer)
        assert episode.turn_lengths == [len(call), len(answer)]
        # The prompt is the template's: system turn with the tool's schema, the question.
        prompt = tokenizer.decode(episode.prompt_ids)
        assert prompt.startswith("<|im_start|>system\nUse the add tool.\n\n# Tools")
        assert '"name": "add"' in prompt
        assert prompt.endswith(
            "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
        )
    assert env.score(groups[0]) == [{"brief": 0.0, "correct": 1.0}] * 2
    assert env.split_traces == 0


def test_a_call_the_template_would_rewrite_is_trained_as_sampled(tool_model_dir, tokenizer):
    """The model's compact JSON call, which the template writes with spaces: the next prompt
    extends the sampled tokens (no re-render), so the trace does not split and the call is
    trained as sampled, the tool result masked, the answer trained."""
    engine = ScriptedEngine(tokenizer, compact_calls=True)
    env, _, groups = run_groups(tool_model_dir, ADD_TOOL, engine, rows=1, group_size=1)
    [episode] = groups[0]
    assert episode.error is None, episode.error
    assert env.split_traces == 0
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call = tokenizer.encode('<tool_call>\n{"name":"add","arguments":{"a":2,"b":3}}\n</tool_call>')
    answer = tokenizer.encode("The answer is 5.") + [im_end]
    tool_turn = tokenizer.encode(
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert episode.response_ids == [*call, im_end, *tool_turn, *answer]
    assert episode.response_mask == [True] * (len(call) + 1) + [False] * len(tool_turn) + [
        True
    ] * len(answer)
    assert (episode.num_turns, episode.tool_calls) == (2, 1)
    # The second request's prompt is the first's, the sampled call and the tool turn.
    assert engine.prompts[0] == episode.prompt_ids
    assert engine.prompts[1] == [*episode.prompt_ids, *call, im_end, *tool_turn]
    assert env.score(groups[0]) == [{"brief": 0.0, "correct": 1.0}]


def test_the_client_renderer_extends_the_sampled_tokens(tool_model_dir, tokenizer):
    """The renderer verifiers' client is given: the next prompt is the previous prompt and
    sampled ids, then the template's tool turn; never a re-tokenised assistant turn."""
    from renderers import create_renderer
    from renderers.base import load_tokenizer

    from grpo.envs.verifiers_renderer import bridge_renderer_config

    renderer = create_renderer(load_tokenizer(str(tool_model_dir)), bridge_renderer_config("qwen3"))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = renderer.render_ids([{"role": "user", "content": "What is 2 + 3?"}])
    call = tokenizer.encode('<tool_call>\n{"name":"add","arguments":{"a":2,"b":3}}\n</tool_call>')
    tool = [{"role": "tool", "tool_call_id": "call_0", "content": "5"}]
    tool_turn = "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"

    bridged = renderer.bridge_to_next_turn(prompt, [*call, im_end], tool)
    assert bridged.token_ids[: len(prompt) + len(call) + 1] == [*prompt, *call, im_end]
    assert tokenizer.decode(bridged.token_ids[len(prompt) + len(call) + 1 :]) == (
        f"\n{tool_turn}<|im_start|>assistant\n"
    )
    assert len(bridged.message_indices) == len(bridged.token_ids)
    # A turn cut before its stop token gets the template's close of the turn first.
    cut = renderer.bridge_to_next_turn(prompt, call, tool)
    assert tokenizer.decode(cut.token_ids[len(prompt) + len(call) :]) == (
        f"<|im_end|>\n{tool_turn}<|im_start|>assistant\n"
    )
    # An assistant turn among the new messages would be re-tokenised: no bridge.
    assistant = {"role": "assistant", "content": "The answer is 5."}
    assert renderer.bridge_to_next_turn(prompt, [*call, im_end], [*tool, assistant]) is None
    assert renderer.bridge_to_next_turn(prompt, [*call, im_end], []) is None


def test_tokens_the_engine_did_not_sample_are_never_trained():
    from grpo.envs import Episode

    sampled = [Sample([7, 8], [-1.0, -2.0], "stop"), Sample([9], [-3.0], "stop")]
    episode = Episode(example={}, prompt_ids=[], messages=[])
    mask = [False, False, True, True, False, True]
    assert _fill_from_branch(episode, [1, 2, 7, 8, 5, 9], mask, sampled) is None
    assert (episode.prompt_ids, episode.response_ids) == ([1, 2], [7, 8, 5, 9])
    assert episode.response_mask == [True, True, False, True]
    assert episode.logprobs == [-1.0, -2.0, 0.0, -3.0]

    retokenized = Episode(example={}, prompt_ids=[], messages=[])
    problem = _fill_from_branch(retokenized, [1, 2, 7, 4, 5, 9], mask, sampled)
    assert problem is not None and "differ from the tokens the engine sampled" in problem
    assert _fill_from_branch(retokenized, [1, 2], [False, False], sampled) == (
        "the trace sampled no token"
    )


def test_an_engine_failure_reaches_the_collector(tool_model_dir, tokenizer):
    def broken(requests):
        raise RuntimeError("engine is down")

    with pytest.raises(RuntimeError, match="engine is down"):
        run_groups(tool_model_dir, ARITHMETIC, broken, rows=1, group_size=1)


# ---------------------------------------------------------------------------- bad input


def test_bad_verifiers_nodes_are_one_line_each(monkeypatch):
    node = {"taskset": "no_such_package.tasks", "max_turns": 0, "tool_parser": "hermes"}
    assert verifiers_problems("environment", node) == [
        "environment.taskset: cannot import 'no_such_package.tasks': "
        "No module named 'no_such_package'",
        "environment.max_turns: expected an int >= 1, got 0",
        "environment.tool_parser: 'hermes' is not one of qwen3, qwen3.5, glm, deepseek-v3",
    ]
    assert verifiers_problems("environment", {"taskset": "grpo.no_such_tasks"}) == [
        "environment.taskset: no module named 'grpo.no_such_tasks' is installed (a verifiers "
        "environment is a module whose __all__ names its Taskset or Harness)"
    ]
    assert verifiers_problems("environment", {"taskset": ARITHMETIC}) == []

    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "verifiers" else find_spec(name, *a),
    )
    assert verifiers_problems("environment", {"taskset": ARITHMETIC}) == [
        'environment: the verifiers extra is not installed; run: pip install -e ".[verifiers]"'
    ]


def test_grpo_validate_names_the_verifiers_mistakes(tiny_model_dir, tmp_path, capsys):
    from grpo.cli import main as grpo_main

    base = [
        "validate",
        "tiny_arithmetic_cpu",
        f"base_model_path={tiny_model_dir}",
        f"output_dir={tmp_path / 'run'}",
        "dataset=null",
    ]
    env = "environment={_component_: grpo.envs.verifiers_env, taskset: %s}"
    assert grpo_main([*base, env % "my_tasks.missing", "eval_every_n_steps=null"]) != 0
    err = capsys.readouterr().err
    assert "environment.taskset: cannot import 'my_tasks.missing'" in err

    assert grpo_main([*base, env % ARITHMETIC]) != 0
    err = capsys.readouterr().err
    assert "eval_every_n_steps: held-out evaluation scores eval_dataset" in err

    assert grpo_main([*base, env % ARITHMETIC, "eval_every_n_steps=null"]) == 0
    assert grpo_main([*base, "environment=null", "eval_every_n_steps=null"]) != 0
    assert (
        "dataset: required key is missing (only an environment with its own tasks"
        in capsys.readouterr().err
    )


COMPACTING_HARNESS = """
import verifiers.v1 as vf
from contextlib import AsyncExitStack
from openai import AsyncOpenAI
from verifiers.v1.harnesses.utils.mcp import connect_mcp

from grpo.envs.verifiers_harness import ChatHarness, _call_tool

__all__ = ["CompactingHarness"]


class CompactingHarness(ChatHarness):
    # An agent that compacts its context: a tool call and its results are folded into one
    # user turn, so the next prompt no longer holds the model's own turn.
    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        spec = {"mcpServers": {name: {"url": url} for name, url in mcp_urls.items()}}
        async with AsyncExitStack() as stack:
            tools, dispatch, servers = await connect_mcp(spec, stack)
            for _ in range(self.config.max_turns):
                completion = await client.chat.completions.create(
                    model=ctx.model, messages=messages, tools=tools
                )
                reply = completion.choices[0].message
                if not reply.tool_calls:
                    break
                results = [await _call_tool(c, dispatch, servers) for c in reply.tool_calls]
                folded = "".join(f"<tool_response>\\n{r}\\n</tool_response>" for r in results)
                messages.append({"role": "user", "content": f"Tool results:\\n{folded}"})
        await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")
"""


@pytest.fixture
def compacting_harness(tmp_path, monkeypatch):
    """A harness module whose agent folds each tool call and its results into a user turn."""
    (tmp_path / "grpo_check_compacting_harness.py").write_text(COMPACTING_HARNESS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "grpo_check_compacting_harness"


def test_an_agent_that_compacts_its_history_trains_the_final_branch_only(
    tool_model_dir, tokenizer, compacting_harness
):
    """The agent's next prompt drops the model's call: it does not extend the sampled tokens,
    so verifiers renders it again and splits the trace; the last branch (the folded result
    as context, the final answer trained) is kept and the split is counted."""
    engine = ScriptedEngine(tokenizer)
    env, _, groups = run_groups(
        tool_model_dir, ADD_TOOL, engine, rows=1, group_size=1, harness=compacting_harness
    )
    [episode] = groups[0]
    assert episode.error is None, episode.error
    assert env.split_traces == 1
    answer = tokenizer.encode("The answer is 5.") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert episode.response_ids == answer and all(episode.response_mask)
    assert episode.num_turns == 1
    prompt = tokenizer.decode(episode.prompt_ids)
    # The question, then the folded result: the model's call is no longer in the conversation.
    assert prompt.endswith(
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>user\nTool results:\n"
        "<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert env.score(groups[0]) == [{"brief": 0.0, "correct": 1.0}]


class HalfToolEngine(ScriptedEngine):
    """Answers every other episode at once, without the tool, so a compacting agent splits
    the episodes that called it and not the others."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.episodes = 0

    def reply(self, text: str) -> str:
        if "<tool_response>" not in text:  # an episode's first turn
            self.episodes += 1
            if self.episodes % 2 == 0:
                return super().reply(text.replace("<tools>", ""))
        return super().reply(text)


def test_each_episode_of_a_group_keeps_its_own_prompt(
    tool_model_dir, tokenizer, compacting_harness
):
    """group_size 4, two split traces beside two whole ones: a split episode's prompt holds its
    re-rendered history, the others' the task's prompt; each trajectory carries its own."""
    from grpo.envs import episode_groups

    engine = HalfToolEngine(tokenizer)
    env, _, groups = run_groups(
        tool_model_dir, ADD_TOOL, engine, rows=1, group_size=4, harness=compacting_harness
    )
    [group] = groups
    assert all(episode.error is None for episode in group), [e.error for e in group]
    assert env.split_traces == 2  # this call's splits, not a running total
    prompts = sorted({tuple(episode.prompt_ids) for episode in group}, key=len)
    assert len(prompts) == 2 and len(prompts[0]) < len(prompts[1])
    [trajectories] = episode_groups(
        groups,
        env.score(group),
        group_ids=[0],
        sequence_id=iter(f"s{n}" for n in range(4)).__next__,
        policy_version=0,
    )
    for episode, trajectory in zip(group, trajectories.trajectories):
        assert trajectory.prompt_tokens.tolist() == episode.prompt_ids
        assert trajectory.prompt_len == len(episode.prompt_ids)
        assert trajectory.response_tokens.tolist() == episode.response_ids
    # A second call counts its own splits; the default harness extends every turn.
    env, _, groups = run_groups(
        tool_model_dir,
        ADD_TOOL,
        ScriptedEngine(tokenizer, compact_calls=True),
        rows=1,
        group_size=4,
    )
    assert env.split_traces == 0


# ---------------------------------------------------------------------------- what a taskset brings

OWN_ENV_TASKS = """
import verifiers.v1 as vf
from grpo.testing.verifiers_arithmetic import SumTaskset

__all__ = ["SumTaskset", "SoloEnv"]


class SoloConfig(vf.SingleAgentEnvConfig):
    note: str = "its own"


class SoloEnv(vf.Env[SoloConfig]):
    async def run(self, task, agents):
        await agents.agent.run(task)
"""

TWO_SEAT_TASKS = """
import verifiers.v1 as vf
from grpo.testing.verifiers_arithmetic import SumTaskset

__all__ = ["SumTaskset", "DuoEnv"]


class DuoConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    checker: vf.AgentConfig = vf.AgentConfig()


class DuoEnv(vf.Env[DuoConfig]):
    async def run(self, task, agents):
        await agents.solver.run(task)
"""

BARE_HARNESS = """
import verifiers.v1 as vf

__all__ = ["BareHarness"]


class BareHarness(vf.Harness[vf.HarnessConfig]):  # its config has no max_turns
    async def launch(self, *args, **kwargs):
        return None
"""


def test_a_taskset_with_its_own_env_and_a_harness_without_max_turns(tmp_path, monkeypatch):
    for name, source in (
        ("grpo_check_solo_tasks", OWN_ENV_TASKS),
        ("grpo_check_duo_tasks", TWO_SEAT_TASKS),
        ("grpo_check_bare_harness", BARE_HARNESS),
    ):
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))

    # The taskset's own single-seat Env plays it, with its own config.
    env = verifiers_env("grpo_check_solo_tasks", max_turns=3)
    assert type(env.env).__name__ == "SoloEnv" and env.env.config.note == "its own"
    assert env.env.config.agent.max_turns == 3 and len(env.examples()) == 4
    # verifiers caps the turns of a harness whose config does not count them.
    env = verifiers_env(ARITHMETIC, harness="grpo_check_bare_harness", max_turns=3)
    assert env.env.config.agent.max_turns == 3
    assert "max_turns" not in type(env.env.config.agent.harness).model_fields
    # An Env of several seats: which one would the policy play? Refused in one line.
    assert verifiers_problems("environment", {"taskset": "grpo_check_duo_tasks"}) == [
        "environment.taskset: grpo_check_duo_tasks exports its own verifiers Env, DuoEnv, "
        "with 2 seats (solver, checker); grpo.envs.verifiers_env trains the one seat of a "
        "single-agent environment: export a Taskset alone, or an Env with one AgentConfig seat"
    ]


def test_grpo_validate_refuses_a_dataset_beside_a_verifiers_environment(
    tiny_model_dir, tmp_path, capsys
):
    from grpo.cli import main as grpo_main

    status = grpo_main(
        [
            "validate",
            "tiny_arithmetic_cpu",
            f"base_model_path={tiny_model_dir}",
            f"output_dir={tmp_path / 'run'}",
            "eval_every_n_steps=null",
            f"environment={{_component_: grpo.envs.verifiers_env, taskset: {ARITHMETIC}}}",
        ]
    )
    err = capsys.readouterr().err
    assert status == 2 and "config has" not in err  # the one problem
    assert (
        "dataset: environment._component_ grpo.envs.verifiers_env generates its own tasks, "
        "which are the data; set dataset: null (or dataset=null on the command line)"
    ) in err


# ---------------------------------------------------------------------------- sampling, concurrency

HOT_SEAT_TASKS = """
import verifiers.v1 as vf
from grpo.testing.verifiers_arithmetic import SumTaskset

__all__ = ["SumTaskset", "HotEnv"]


class HotConfig(vf.SingleAgentEnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(sampling=vf.SamplingConfig(temperature=0.7))


class HotEnv(vf.Env[HotConfig]):
    async def run(self, task, agents):
        await agents.agent.run(task)
"""


def test_a_harness_or_seat_that_sets_its_own_sampling_is_refused(tmp_path, monkeypatch):
    """The engine samples every turn with inference.temperature (the logprobs are those): a
    temperature of the harness or of the taskset's seat would be ignored, so it is refused."""
    (tmp_path / "grpo_check_hot_tasks.py").write_text(HOT_SEAT_TASKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    node = {
        "taskset": ARITHMETIC,
        "harness_args": {"temperature": 0.2, "tool_timeout": 5.0},
        "max_concurrent_episodes": 0,
    }
    assert verifiers_problems("environment", node) == [
        "environment.max_concurrent_episodes: expected an int >= 1, got 0",
        "environment.harness_args.temperature: the collector's engine samples every turn "
        "with inference.temperature and inference.top_p (the logprobs trained against are "
        "those); set them there",
    ]
    assert verifiers_problems("environment", {"taskset": "grpo_check_hot_tasks"}) == [
        "environment.taskset: grpo_check_hot_tasks exports its own verifiers Env, HotEnv, "
        "whose agent seat samples with its own temperature; the collector's engine samples "
        "every turn with inference.temperature and inference.top_p: set them there and leave "
        "the seat's sampling unset"
    ]
    with pytest.raises(ValueError, match="harness_args.temperature"):
        verifiers_env(ARITHMETIC, harness_args={"temperature": 0.2})


def test_max_concurrent_episodes_bounds_the_episodes_in_flight(tool_model_dir, tokenizer):
    """At most that many episodes (their tool servers included) run at once: with one, the
    engine is never asked for two turns together, and every episode still finishes."""
    batches = []

    class CountingEngine(ScriptedEngine):
        def __call__(self, requests):
            batches.append(len(requests))
            return super().__call__(requests)

    env, _, groups = run_groups(
        tool_model_dir,
        ADD_TOOL,
        CountingEngine(tokenizer),
        rows=2,
        group_size=2,
        max_concurrent_episodes=1,
    )
    assert [e.error for g in groups for e in g] == [None] * 4
    assert batches == [1] * 8  # 4 episodes of 2 turns, one turn at a time


def test_an_endless_taskset_is_read_up_to_max_tasks():
    env = verifiers_env("grpo.testing.verifiers_endless", max_tasks=5)
    assert [row["index"] for row in env.examples()] == [0, 1, 2, 3, 4]
    assert env.examples()[4]["question"] == "What is 4 + 4?"
    assert verifiers_problems("environment", {"taskset": ARITHMETIC, "max_tasks": 0}) == [
        "environment.max_tasks: expected an int >= 1, got 0"
    ]
