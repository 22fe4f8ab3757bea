"""Environment turns on each family's published chat template, token-exact.

The templates are the ones each model's ``tokenizer_config.json`` carries (fixtures under
``tests/fixtures/chat_templates``, sources in SOURCES.md there), on tiny models whose tokenizers
hold the family's special tokens (`tests.helpers.chat_families`). For each: a 3-turn tool episode
with calls in the family's own format and a 2-turn user-reply episode, where the trained tokens
must be exactly the sampled ones and the rest exactly what the template writes for the
environment's turns; then the collector's real vLLM engine plays episodes on the family model.

The tests that start a Ray cluster or a vLLM engine: tests/integration/test_chat_families.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.envs import ChatTurnRenderer, ToolEnv, chat_template_problem, run_episodes
from grpo.envs.builtin_tools import calculator
from grpo.envs.preflight import chat_template_problems
from grpo.envs.rollout import Sample
from grpo.models import load_tokenizer
from grpo.rewards import MathCorrectnessReward
from grpo.testing.tools import EchoUserEnv
from tests.helpers.chat_families import build_tiny_chat_family

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()

# (template fixture, family of tokens, template variables, tool-call format)
VARIANTS = {
    "qwen2_5": ("qwen2_5", "qwen2_5", {}, "json"),
    "qwen3": ("qwen3", "qwen3", {}, "json"),
    "qwen3_no_thinking": ("qwen3", "qwen3", {"enable_thinking": False}, "json"),
    "llama3_1": ("llama3_1", "llama3", {}, "llama3_json"),
    "llama3_2": ("llama3_2", "llama3", {}, "llama3_json"),
    "llama3_3": ("llama3_3", "llama3", {}, "llama3_json"),
    "deepseek_r1_distill_qwen": (
        "deepseek_r1_distill_qwen",
        "deepseek_r1_distill_qwen",
        {},
        "deepseek",
    ),
}


def tool_call(call_format: str, expression: str) -> str:
    """A calculator call as the family's template teaches it."""
    if call_format == "json":
        return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
    if call_format == "llama3_json":
        return f'{{"name": "calculator", "parameters": {{"expression": "{expression}"}}}}'
    return (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n```json\n"
        f'{{"expression": "{expression}"}}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )


# What each template writes after the policy's turn for the tool's result "6" (the first) and
# "7" (the second), read off the published templates; None: the turn ended on its own stop token
# (the template's close of the turn is then already sampled).
TOOL_TURNS = {
    "json": (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n{r}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n{opening}"
    ),
    "llama3_json": (
        '<|start_header_id|>ipython<|end_header_id|>\n\n"{r}"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
}
# The call turn ended on the stop string <｜tool▁calls▁end｜>: the template's close of the turn
# comes first. Its template numbers tool outputs across the conversation: later ones lack the
# opening marker.
DEEPSEEK_TOOL_TURNS = (
    "<｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>6<｜tool▁output▁end｜>"
    "<｜tool▁outputs▁end｜>",
    "<｜end▁of▁sentence｜>\n<｜tool▁output▁begin｜>7<｜tool▁output▁end｜><｜tool▁outputs▁end｜>",
)
USER_TURNS = {
    "qwen": "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n{opening}",
    "llama3": (
        "<|start_header_id|>user<|end_header_id|>\n\nagain<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "deepseek_r1_distill_qwen": "<｜User｜>again<｜Assistant｜><think>\n",
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    built = {}
    for template, family, _, _ in VARIANTS.values():
        if template not in built:
            text = (TEMPLATES / f"{template}.jinja").read_text()
            built[template] = build_tiny_chat_family(root / template, family, text)
    return built


class ScriptedEngine:
    """Samples ``script[t]`` at turn t, closed by a stop token or (``close=False``) not,
    as when a stop string such as ``</tool_call>`` ended it."""

    def __init__(self, tokenizer, script, close_token: int | None):
        self.tokenizer = tokenizer
        self.script = script
        self.close_token = close_token
        self.requests = []
        self.sampled = []

    def __call__(self, requests):
        samples = []
        for request in requests:
            turn = sum(request.token_ids[: len(r)] == r for r in self.requests)
            self.requests.append(list(request.token_ids))
            ids = self.tokenizer.encode(self.script[turn], add_bos=False, add_eos=False)
            if self.close_token is not None:
                ids.append(self.close_token)
            self.sampled.append(ids)
            samples.append(Sample(ids, [-0.5] * len(ids), "stop"))
        return samples


def _prompt(tokenizer, question, kwargs, tools=None):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tools=tools, **kwargs
    )
    return {"question": question, "answer": "7", "index": 0}, tokenizer.encode(
        text, add_bos=False, add_eos=False
    )


def _segments(episode):
    """The response as runs of (trained?, token ids)."""
    runs = []
    for token, trained in zip(episode.response_ids, episode.response_mask):
        if runs and runs[-1][0] == trained:
            runs[-1][1].append(token)
        else:
            runs.append((trained, [token]))
    return runs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tool_episode_is_the_sampled_tokens_and_the_templates_tool_turns(family_dirs, variant):
    template, family, kwargs, call_format = VARIANTS[variant]
    tokenizer = load_tokenizer(family_dirs[template])
    assert chat_template_problem(tokenizer, kwargs) is None
    renderer = ChatTurnRenderer(tokenizer, kwargs)
    env = ToolEnv(
        tools=[calculator],
        call_format=call_format,
        reward_functions=[MathCorrectnessReward()],
        max_turns=5,
    )
    script = [tool_call(call_format, "2*3"), tool_call(call_format, "6+1"), "<answer>7</answer>"]
    # A Hermes or DeepSeek call ends on its stop string; Llama's model closes its call turn with
    # <|eom_id|>, a stop token that is not the template's <|eot_id|>.
    close = {"json": None, "deepseek": None}.get(
        call_format, tokenizer.hf_tokenizer.convert_tokens_to_ids("<|eom_id|>")
    )
    engine = ScriptedEngine(tokenizer, script, close)
    example, prompt_ids = _prompt(tokenizer, "What is 2*3+1?", kwargs, env.tool_schemas())
    [[episode]] = run_episodes(
        env, engine, tokenizer, renderer, [(example, prompt_ids)],
        group_size=1, max_tokens_per_turn=256, max_model_len=4096, seeds=[0],
    )  # fmt: skip

    assert episode.error is None, episode.error
    assert (episode.num_turns, episode.tool_calls, episode.tool_errors) == (3, 2, {})
    assert [m["content"] for m in episode.messages if m["role"] == "tool"] == ["6", "7"]
    runs = _segments(episode)
    assert [trained for trained, _ in runs] == [True, False, True, False, True]
    # Trained: exactly what the engine sampled, turn by turn.
    assert [ids for trained, ids in runs if trained] == engine.sampled
    # The rest: exactly the template's tool turns, in the family's own format.
    env_turns = [tokenizer.decode(ids) for trained, ids in runs if not trained]
    if call_format == "deepseek":
        assert env_turns == list(DEEPSEEK_TOOL_TURNS)
    else:
        opening = "<think>\n\n</think>\n\n" if kwargs.get("enable_thinking") is False else ""
        assert env_turns == [TOOL_TURNS[call_format].format(r=r, opening=opening) for r in "67"]
    # Every turn's request extends the sequence before it: nothing was re-tokenised.
    for earlier, later in zip(engine.requests, engine.requests[1:]):
        assert later[: len(earlier)] == earlier
    assert engine.requests[-1] == prompt_ids + episode.response_ids[: -len(engine.sampled[-1])]
    assert env.score([episode]) == [{"math_correctness": 1.0}]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_user_reply_episode_extends_the_sampled_tokens(family_dirs, variant):
    template, family, kwargs, _ = VARIANTS[variant]
    tokenizer = load_tokenizer(family_dirs[template])
    env = EchoUserEnv(max_turns=2, reward_functions=[MathCorrectnessReward()])
    engine = ScriptedEngine(tokenizer, ["7?", "7"], close_token=tokenizer.eos_id)
    example, prompt_ids = _prompt(tokenizer, "What is 2*3+1?", kwargs)
    [[episode]] = run_episodes(
        env, engine, tokenizer, ChatTurnRenderer(tokenizer, kwargs), [(example, prompt_ids)],
        group_size=1, max_tokens_per_turn=64, max_model_len=4096, seeds=[0],
    )  # fmt: skip

    assert episode.error is None and episode.hit_max_turns and episode.num_turns == 2
    runs = _segments(episode)
    assert [ids for trained, ids in runs if trained] == engine.sampled
    [(_, user_turn)] = [run for run in runs if not run[0]]
    key = "qwen" if family.startswith("qwen") else family
    opening = "<think>\n\n</think>\n\n" if kwargs.get("enable_thinking") is False else ""
    assert tokenizer.decode(user_turn) == USER_TURNS[key].format(opening=opening)


def test_a_chat_prompt_lists_the_tools_in_the_familys_format(family_dirs):
    from grpo.data import ChatTemplate

    qwen3 = ChatTemplate(
        family_dirs["qwen3"],
        tools=["grpo.envs.builtin_tools.calculator"],
        chat_template_kwargs={"enable_thinking": False},
    )
    text = qwen3("What is 2*3+1?")
    assert "<tools>" in text and '"name": "calculator"' in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    llama = ChatTemplate(family_dirs["llama3_1"], tools=["grpo.envs.builtin_tools.calculator"])
    assert '"name": "calculator"' in llama("What is 2*3+1?")


def test_llama_environment_turns_do_not_depend_on_the_date(family_dirs):
    """Llama 3's template writes today's date into the system header: an episode that crosses
    midnight still extends its tokens (the environment's turns come after the header)."""
    tokenizer = load_tokenizer(family_dirs["llama3_1"])
    history = [{"role": "user", "content": "What is 2*3+1?"}]
    turns = [{"role": "tool", "content": "6"}]
    days = [
        ChatTurnRenderer(tokenizer, {"date_string": day}).env_tokens(turns, True, history)
        for day in ("31 Dec 2026", "01 Jan 2027")
    ]
    assert days[0] == days[1]
    prompts = {
        tokenizer.apply_chat_template(history, date_string=day)
        for day in ("31 Dec 2026", "01 Jan 2027")
    }
    assert len(prompts) == 2  # the header does move


def test_a_template_that_rewrites_the_assistant_turn_is_refused_in_one_line(tmp_path):
    # A template that drops an assistant turn's text once a tool turn follows it: the sampled
    # tokens could not be extended.
    template = (
        "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}"
        "<|im_start|>assistant\n<|im_end|>\n{% else %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    folder = build_tiny_chat_family(tmp_path / "odd", "qwen2_5", template)
    problem = chat_template_problem(load_tokenizer(folder))
    assert problem is not None and "\n" not in problem
    assert str(folder) in problem and "does not keep an assistant turn's text" in problem
    with pytest.raises(ValueError, match="does not keep"):
        ChatTurnRenderer(load_tokenizer(folder))
    # grpo validate runs the same check on a chat prompt template beside an environment.
    env = {"_component_": "grpo.envs.ToolEnv", "tools": ["grpo.envs.calculator"]}
    node = {"_component_": "grpo.data.ChatTemplate", "model_dir": str(folder)}
    tool_problem = chat_template_problem(load_tokenizer(folder), roles=("tool",))
    assert chat_template_problems("dataset.template", node, env) == [
        f"dataset.template: {tool_problem}"
    ]
    # The template's folder is the run's model when the node names none.
    unnamed = {"_component_": "grpo.data.ChatTemplate"}
    assert chat_template_problems("dataset.template", unnamed, env, str(folder)) == [
        f"dataset.template: {tool_problem}"
    ]
    good = {**node, "model_dir": str(build_tiny_chat_family(tmp_path / "q3", "qwen3", QWEN3))}
    assert chat_template_problems("dataset.template", good, env) == []


def test_which_templates_write_environment_turns_after_the_history_their_own_way(family_dirs):
    """DeepSeek-R1's template opens its tool outputs once per conversation: its environment
    tokens depend on the turns before them (the rollout passes the episode's own, the verifiers
    bridge declines); the others' do not. A user-reply environment is checked on user turns
    only."""
    dependent = {
        template: ChatTurnRenderer(load_tokenizer(folder)).history_dependent
        for template, folder in family_dirs.items()
    }
    assert dependent == {template: template.startswith("deepseek") for template in family_dirs}
    r1 = ChatTurnRenderer(load_tokenizer(family_dirs["deepseek_r1_distill_qwen"]), roles=("user",))
    assert not r1.history_dependent


def test_a_template_without_a_tool_role_serves_a_user_reply_environment(tmp_path):
    template = (
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('only user and assistant roles') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer = load_tokenizer(build_tiny_chat_family(tmp_path / "strict", "qwen2_5", template))
    assert chat_template_problem(tokenizer, roles=("user",)) is None
    problem = chat_template_problem(tokenizer, roles=("tool",))
    assert problem is not None and "only user and assistant roles" in problem
