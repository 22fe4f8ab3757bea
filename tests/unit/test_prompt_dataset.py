"""Datasets from your own files (prompt_dataset) and prompts from the model's chat template.

The tests that start a Ray cluster or a vLLM engine: tests/integration/test_prompt_dataset.py.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo.config import instantiate
from grpo.data import (
    THINK_ANSWER_INSTRUCTION,
    ChatTemplate,
    PromptDataset,
    PromptStream,
    RegexAnswerExtractor,
    extract_gsm8k_answer,
    filter_long_prompts,
    gsm8k_dataset,
    prompt_dataset,
)

# The chat template of Qwen2.5-*-Instruct, as in its tokenizer_config.json: a default system
# turn when the conversation has none, and a tools branch.
QWEN25_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# The chat template of Llama-3-8B-Instruct: it writes the bos token itself.
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
LLAMA3_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)

CONVERSATION = [
    {"role": "system", "content": "Answer in <answer> tags."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "<answer>5</answer>"},
    {"role": "user", "content": "And 4 + 4?"},
]


def _set_chat_template(model_dir: Path, template: str | None) -> None:
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if template is None:
        config.pop("chat_template", None)
    else:
        config["chat_template"] = template
    path.write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def qwen25_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 folder with Qwen2.5-Instruct's real chat template."""
    model_dir = tmp_path_factory.mktemp("chat") / "qwen25"
    shutil.copytree(tiny_model_dir, model_dir)
    _set_chat_template(model_dir, QWEN25_CHAT_TEMPLATE)
    return model_dir


@pytest.fixture(scope="module")
def llama3_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny tokenizer with Llama 3's special tokens, bos token and chat template.

    Like Llama 3's tokenizer, encoding with special tokens prepends ``<|begin_of_text|>``.
    """
    from tokenizers import AddedToken, Tokenizer, processors

    model_dir = tmp_path_factory.mktemp("chat") / "llama3"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in LLAMA3_SPECIAL_TOKENS]
    )
    bos = LLAMA3_SPECIAL_TOKENS[0]
    bos_id = tokenizer.token_to_id(bos)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)]
            ),
        ]
    )
    tokenizer.save(str(model_dir / "tokenizer.json"))
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for token in LLAMA3_SPECIAL_TOKENS:
        config["added_tokens_decoder"][str(tokenizer.token_to_id(token))] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    config.update(
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token=bos,
        eos_token="<|eot_id|>",
        chat_template=LLAMA3_CHAT_TEMPLATE,
    )
    config.pop("additional_special_tokens", None)
    path.write_text(json.dumps(config, indent=2))
    return model_dir


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("\n".join(row if isinstance(row, str) else json.dumps(row) for row in rows))
    return path


# ---------------------------------------------------------------- prompt_dataset: columns


CUSTOM_ROWS = [
    {"problem": "Tom has 3 apples and buys 4. How many?", "solution": "3 + 4 = 7\n#### 7", "id": 1},
    {"problem": "  ", "solution": "#### 1", "id": 2},
    {"problem": "A car costs $1,234.", "solution": "#### 1,234", "id": 3},
    {"problem": "Why?", "solution": "Because.", "id": 4},
    {"problem": "Lost 5 from 0.", "id": 5},
]
CUSTOM_ANSWERS = ["7", "1234"]
CUSTOM_SKIPPED = [
    (2, "empty problem"),
    (4, "answer_extractor extract_gsm8k_answer found no answer in solution"),
    (5, "missing solution"),
]


def _custom_dataset(source: Path, **kwargs) -> PromptDataset:
    return prompt_dataset(
        source,
        prompt_key="problem",
        answer_key="solution",
        answer_extractor=extract_gsm8k_answer,
        template="answer_only",
        **kwargs,
    )


def test_prompt_dataset_from_jsonl_json_and_parquet_with_custom_columns(tmp_path):
    jsonl = _write_jsonl(tmp_path / "train.jsonl", [*CUSTOM_ROWS, "{broken"])
    from_jsonl = _custom_dataset(jsonl)
    assert [e["answer"] for e in from_jsonl.examples] == CUSTOM_ANSWERS
    assert from_jsonl.rows == [1, 3]
    assert from_jsonl.skipped.examples[:3] == CUSTOM_SKIPPED
    assert from_jsonl.skipped.count == 4
    assert from_jsonl.skipped.examples[3][0] == 6
    assert from_jsonl.skipped.examples[3][1].startswith("not valid JSON")
    # The row's other columns ride along, for environments.
    assert from_jsonl[0] == {
        "id": 1,
        "question": CUSTOM_ROWS[0]["problem"],
        "answer": "7",
        "prompt": CUSTOM_ROWS[0]["problem"] + "\n",
    }

    json_path = tmp_path / "train.json"
    json_path.write_text(json.dumps(CUSTOM_ROWS))
    from_json = _custom_dataset(json_path)
    assert [e["answer"] for e in from_json.examples] == CUSTOM_ANSWERS
    assert from_json.skipped.examples == CUSTOM_SKIPPED

    parquet_path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(CUSTOM_ROWS), parquet_path)
    from_parquet = _custom_dataset(parquet_path)
    assert [e["answer"] for e in from_parquet.examples] == CUSTOM_ANSWERS
    assert from_parquet.skipped.examples == CUSTOM_SKIPPED
    assert from_parquet.skipped.summary().startswith(
        f"skipped 3 rows of {parquet_path}: row 2: empty problem; row 4: "
    )
    assert from_parquet[0] == from_json[0] == from_jsonl[0]


def test_prompt_dataset_answers_without_extractor_and_num_examples(tmp_path):
    rows = [{"q": f"What is {i} + 1?", "a": i + 1} for i in range(5)] + [{"q": "x", "a": True}]
    path = _write_jsonl(tmp_path / "numbers.jsonl", rows)
    dataset = prompt_dataset(path, prompt_key="q", answer_key="a", template="answer_only")
    assert [e["answer"] for e in dataset.examples] == ["1", "2", "3", "4", "5"]  # numbers as text
    assert dataset.skipped.examples == [(6, "a is not a string (bool)")]
    first_two = prompt_dataset(path, prompt_key="q", answer_key="a", num_examples=2)
    assert [e["answer"] for e in first_two.examples] == ["1", "2"]
    with pytest.raises(ValueError, match="num_examples: expected an int >= 1 or null, got 0"):
        prompt_dataset(path, prompt_key="q", answer_key="a", num_examples=0)


def test_answer_extractor_from_a_component_node_and_a_dotted_path(tmp_path):
    path = _write_jsonl(
        tmp_path / "boxed.jsonl",
        [
            {"problem": "2 + 2?", "solution": "We add. The answer is 4."},
            {"problem": "1000 + 24?", "solution": "The answer is 1,000. No: The answer is 1,024."},
            {"problem": "?", "solution": "Unknown."},
        ],
    )
    node = {
        "_component_": "grpo.data.prompt_dataset",
        "source": str(path),
        "prompt_key": "problem",
        "answer_key": "solution",
        "answer_extractor": {
            "_component_": "grpo.data.RegexAnswerExtractor",
            "pattern": r"The answer is ([\d,]+)\.",
            "remove": ",",
        },
        "template": "answer_only",
    }
    dataset = instantiate(node)
    assert [e["answer"] for e in dataset.examples] == ["4", "1024"]
    assert dataset.skipped.count == 1 and dataset.skipped.examples[0][0] == 3
    assert "RegexAnswerExtractor" in dataset.skipped.examples[0][1]

    gsm8k_path = _write_jsonl(tmp_path / "g.jsonl", [{"q": "a", "s": "#### 1,000"}])
    by_path = instantiate(
        {
            "_component_": "grpo.data.prompt_dataset",
            "source": str(gsm8k_path),
            "prompt_key": "q",
            "answer_key": "s",
            "answer_extractor": "grpo.data.extract_gsm8k_answer",
        }
    )
    assert by_path.examples == [{"question": "a", "answer": "1000"}]
    with pytest.raises(ValueError, match="answer_extractor 'grpo.data.no_such_fn'"):
        prompt_dataset(
            gsm8k_path, prompt_key="q", answer_key="s", answer_extractor="grpo.data.no_such_fn"
        )
    with pytest.raises(ValueError, match="invalid pattern"):
        RegexAnswerExtractor("([")


def test_gsm8k_preset_matches_prompt_dataset(tmp_path):
    rows = [
        {"question": "Tom has 3 apples and buys 4.", "answer": "3 + 4 = 7\n#### 7"},
        {"question": "Why?", "answer": "Because 72."},
    ]
    path = _write_jsonl(tmp_path / "gsm8k.jsonl", rows)
    preset = gsm8k_dataset(path)
    general = prompt_dataset(
        path, prompt_key="question", answer_key="answer", answer_extractor=extract_gsm8k_answer
    )
    assert preset.examples == general.examples == [{"question": rows[0]["question"], "answer": "7"}]
    assert preset[0]["prompt"] == general[0]["prompt"]
    assert preset.skipped.examples == [(2, "answer has no '#### <number>' final answer")]
    assert preset.name == f"gsm8k:{path}"


# ---------------------------------------------------------------- prompt_dataset: errors


def test_missing_column_names_the_file_the_column_and_the_columns_it_has(tmp_path):
    jsonl = _write_jsonl(tmp_path / "train.jsonl", [{"problem": "q", "solution": "1"}])
    with pytest.raises(ValueError) as error:
        prompt_dataset(jsonl, prompt_key="question", answer_key="solution")
    message = str(error.value)
    assert str(jsonl) in message and "'question'" in message
    assert "['problem', 'solution']" in message
    parquet = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "q", "solution": "1"}]), parquet)
    with pytest.raises(ValueError, match=re.escape(f"{parquet} has no column 'answer'")):
        prompt_dataset(parquet, prompt_key="problem", answer_key="answer")


def test_source_errors(tmp_path):
    missing = tmp_path / "nowhere" / "train.jsonl"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        prompt_dataset(missing)
    csv = tmp_path / "train.csv"
    csv.write_text("prompt,answer\nq,1\n")
    with pytest.raises(ValueError, match=r"unsupported dataset file extension '\.csv'"):
        prompt_dataset(csv)
    folder = tmp_path / "folder.jsonl"
    folder.mkdir()
    with pytest.raises(ValueError, match="is not a file"):
        prompt_dataset(folder)


def test_malformed_chat_turns_are_skipped_and_all_bad_is_an_error(tmp_path, qwen25_dir):
    good = [{"role": "user", "content": "What is 1 + 1?"}]
    rows = [
        {"messages": good, "answer": "2"},
        {"messages": [{"role": "user"}], "answer": "1"},
        {"messages": {"role": "user", "content": "Hi"}, "answer": "1"},
        {"messages": [], "answer": "1"},
        {"messages": [{"role": "assistant", "content": "Hi"}], "answer": "1"},
        {"messages": ["user: hi"], "answer": "1"},
    ]
    path = _write_jsonl(tmp_path / "chat.jsonl", rows)
    template = ChatTemplate(qwen25_dir)
    dataset = prompt_dataset(path, prompt_key="messages", template=template)
    assert len(dataset) == 1
    assert dataset.skipped.examples == [
        (2, "messages: turn 1 has no string 'content'"),
        (3, "messages is not a string (dict)"),
        (4, "messages: no chat turns"),
        (5, "messages has no user turn"),
        (6, "messages: turn 1 is not a {role, content} mapping (str)"),
    ]
    all_bad = _write_jsonl(tmp_path / "bad.jsonl", rows[1:])
    with pytest.raises(
        ValueError, match=r"no usable dataset rows in .*bad\.jsonl.*row 1: .*row 2: "
    ):
        prompt_dataset(all_bad, prompt_key="messages", template=template)


# ---------------------------------------------------------------- chat turns and templates


def test_chat_turns_column_renders_with_the_model_chat_template(tmp_path, qwen25_dir):
    from transformers import AutoTokenizer

    rows = [
        {"messages": CONVERSATION, "answer": 8},  # numeric answers become text
        {"messages": [{"role": "user", "content": "What is 6 * 7?"}], "answer": 42},
    ]
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    dataset = prompt_dataset(path, prompt_key="messages", template=ChatTemplate(qwen25_dir))
    hf = AutoTokenizer.from_pretrained(qwen25_dir)
    assert dataset[0]["question"] == "And 4 + 4?"  # the last user turn, for logs
    assert dataset[0]["messages"] == CONVERSATION
    assert dataset[0]["prompt"] == hf.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )
    # Without a system turn, Qwen2.5's template writes its own default one.
    assert dataset[1]["prompt"] == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert dataset[1]["answer"] == "42"


def test_chat_turns_with_a_plain_template_name_the_row(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "Hi"}], "answer": "1"}]
    path = _write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(
        ValueError, match=r"row 1: column 'messages' holds chat turns.*ChatTemplate"
    ):
        prompt_dataset(path, prompt_key="messages", template="think_answer")
    with pytest.raises(ValueError, match="row 1 holds chat turns.*ChatTemplate"):
        PromptDataset([{"question": "Hi", "answer": "1", "messages": rows[0]["messages"]}], str)


def test_system_prompt(tmp_path, qwen25_dir):
    path = _write_jsonl(
        tmp_path / "q.jsonl",
        [
            {"question": "What is 2 + 2?", "answer": "4"},
            {"question": CONVERSATION, "answer": "8"},  # has its own system turn: kept
        ],
    )
    with pytest.raises(ValueError, match="system_prompt.*ChatTemplate"):
        prompt_dataset(path, prompt_key="question", system_prompt="Be brief.")
    dataset = prompt_dataset(
        path,
        prompt_key="question",
        system_prompt=THINK_ANSWER_INSTRUCTION,
        template=ChatTemplate(qwen25_dir),
    )
    assert dataset[0]["messages"] == [
        {"role": "system", "content": THINK_ANSWER_INSTRUCTION},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    # The prompt the hand-written ChatML template used to give the Qwen2.5 configs.
    assert dataset[0]["prompt"] == (
        f"<|im_start|>system\n{THINK_ANSWER_INSTRUCTION}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert dataset[1]["messages"] == CONVERSATION
    # The same from the template's own system prompt, as the shipped configs set it.
    template = ChatTemplate(qwen25_dir, system_prompt=THINK_ANSWER_INSTRUCTION)
    assert (
        gsm8k_dataset(
            _write_jsonl(
                tmp_path / "g.jsonl", [{"question": "What is 2 + 2?", "answer": "#### 4"}]
            ),
            template=template,
        )[0]["prompt"]
        == dataset[0]["prompt"]
    )
    assert template.stop == ("</answer>",)


def test_chat_template_errors_name_the_folder_and_row(tmp_path, tiny_model_dir):
    no_template = tmp_path / "base_model"
    shutil.copytree(tiny_model_dir, no_template)
    _set_chat_template(no_template, None)
    with pytest.raises(
        ValueError, match=re.escape(f"model folder {str(no_template)!r} has no chat template")
    ):
        ChatTemplate(no_template)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        ChatTemplate(tmp_path / "nowhere")

    failing = tmp_path / "failing_model"
    shutil.copytree(tiny_model_dir, failing)
    _set_chat_template(
        failing,
        "{% for m in messages %}{% if m['role'] == 'assistant' %}"
        "{{ raise_exception('no assistant turns') }}{% endif %}{{ m['content'] }}{% endfor %}",
    )
    rows = [
        {"messages": [{"role": "user", "content": "Hi"}], "answer": "1"},
        {
            "messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}],
            "answer": "2",
        },
    ]
    path = _write_jsonl(tmp_path / "chat.jsonl", rows)
    dataset = prompt_dataset(path, prompt_key="messages", template=ChatTemplate(failing))
    assert len(dataset) == 1
    ((row, reason),) = dataset.skipped.examples
    assert row == 2 and str(failing) in reason and "no assistant turns" in reason
    with pytest.raises(
        ValueError, match=rf"row 1: .*{re.escape(str(failing))}.*no assistant turns"
    ):
        PromptDataset(
            [{"question": "y", "answer": "2", "messages": rows[1]["messages"]}],
            ChatTemplate(failing),
        )


def test_chat_template_pickles_without_its_tokenizer(tmp_path, qwen25_dir):
    template = ChatTemplate(qwen25_dir, system_prompt="Be brief.")
    dataset = PromptDataset([{"question": "What is 1 + 1?", "answer": "2"}], template)
    state = pickle.dumps(dataset)
    assert len(state) < 2000  # the path and the examples, no tokenizer
    copy = pickle.loads(state)
    assert copy[0]["prompt"] == dataset[0]["prompt"]


def test_stream_and_length_filter_with_chat_examples(tmp_path, qwen25_dir):
    from grpo.models import load_tokenizer

    rows = [
        {"messages": [{"role": "user", "content": "word " * n}], "answer": str(n)}
        for n in (1, 30, 2, 3)
    ]
    path = _write_jsonl(tmp_path / "chat.jsonl", rows)
    dataset = prompt_dataset(path, prompt_key="messages", template=ChatTemplate(qwen25_dir))
    tokenizer = load_tokenizer(qwen25_dir)

    def encode(text: str) -> list[int]:  # as the collector does for a chat template
        return tokenizer.encode(text, add_bos=dataset.template.add_bos, add_eos=False)

    limit = len(encode(dataset.prompt(3)))
    short = filter_long_prompts(dataset, encode, max_prompt_tokens=limit)
    assert short.rows == [1, 3, 4]
    assert short.skipped.examples[0][0] == 2
    batch = PromptStream(short, worker_id=0, num_workers=1, seed=0).next_batch(3)
    assert sorted(item["answer"] for item in batch) == ["1", "2", "3"]
    assert all(item["prompt"].endswith("<|im_start|>assistant\n") for item in batch)
    assert all(item["question"].startswith("word") for item in batch)


def test_llama3_chat_template_writes_the_bos_token_once(llama3_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(llama3_dir)
    template = ChatTemplate(llama3_dir)
    prompt = template(CONVERSATION)
    assert prompt == hf.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert prompt.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert prompt.count("<|begin_of_text|>") == 1
    bos_id = hf.convert_tokens_to_ids("<|begin_of_text|>")
    ids = hf.encode(prompt, add_special_tokens=False)
    assert ids.count(bos_id) == 1 and ids[0] == bos_id
    # Adding special tokens on top would give two: hence add_bos=False for chat templates.
    assert hf.encode(prompt, add_special_tokens=True)[:2] == [bos_id, bos_id]
    assert template.add_bos is False


@pytest.mark.parametrize("name", ["qwen2_5_0_5b_gsm8k", "qwen2_5_1_5b_gsm8k", "qwen2_5_3b_gsm8k"])
def test_shipped_configs_prompt_with_the_model_chat_template(name, qwen25_dir):
    from grpo.config import compose_config

    cfg = compose_config(name, [f"base_model_path={qwen25_dir}"])
    for key in ("dataset", "eval_dataset"):
        template = instantiate(cfg[key].template)
        assert isinstance(template, ChatTemplate) and template.stop == ("</answer>",)
        assert template.system_prompt == THINK_ANSWER_INSTRUCTION
        assert template("What is 2 + 2?") == (
            f"<|im_start|>system\n{THINK_ANSWER_INSTRUCTION}<|im_end|>\n"
            "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
        )
