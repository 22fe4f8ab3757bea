"""Tests of `grpo.data.preflight.dataset_problems`: cheap dataset checks for ``grpo validate``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grpo.data.preflight import dataset_problems

PROMPT = "grpo.data.prompt_dataset"
GSM8K = "grpo.data.gsm8k_dataset"
CHAT = {"_component_": "grpo.data.ChatTemplate"}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def model_folder(path: Path, chat_template: str | None = None, jinja: bool = False) -> Path:
    """A model folder with only what the chat template check reads."""
    path.mkdir()
    config = {"eos_token": "<|im_end|>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja:
        (path / "chat_template.jinja").write_text("{{ messages }}")
    return path


QA_ROWS = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(3)]
CHAT_ROWS = [
    {"messages": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1)}
    for i in range(3)
]


def test_other_components_are_not_checked(tmp_path):
    node = {"_component_": "grpo.data.arithmetic_dataset", "source": str(tmp_path / "x.jsonl")}
    assert dataset_problems("dataset", node, None) == []


def test_missing_file(tmp_path):
    source = str(tmp_path / "train.jsonl")
    node = {"_component_": PROMPT, "source": source}
    assert dataset_problems("dataset", node, None) == [
        f"dataset.source: file {source} does not exist"
    ]


def test_hub_names_are_not_checked():
    assert dataset_problems("dataset", {"_component_": GSM8K}, None) == []
    node = {"_component_": PROMPT, "source": "openai/gsm8k", "prompt_key": "nope"}
    assert dataset_problems("dataset", node, None) == []


def test_unsupported_extension(tmp_path):
    source = tmp_path / "train.csv"
    source.write_text("question,answer\nWhat is 1 + 1?,2\n")
    problems = dataset_problems("dataset", {"_component_": PROMPT, "source": str(source)}, None)
    assert len(problems) == 1
    assert problems[0].startswith("dataset.source: unsupported file extension '.csv'")


def test_missing_prompt_column_names_it_and_the_available_ones(tmp_path):
    source = str(write_jsonl(tmp_path / "train.jsonl", QA_ROWS))
    node = {
        "_component_": PROMPT,
        "source": source,
        "prompt_key": "problem",
        "answer_key": "answer",
    }
    assert dataset_problems("dataset", node, None) == [
        f"dataset.prompt_key: column 'problem' not in {source}; its columns: question, answer"
    ]


def test_default_prompt_key_is_prompt(tmp_path):
    source = str(write_jsonl(tmp_path / "train.jsonl", QA_ROWS))
    problems = dataset_problems("dataset", {"_component_": PROMPT, "source": source}, None)
    assert problems == [
        f"dataset.prompt_key: column 'prompt' not in {source}; its columns: question, answer"
    ]


def test_missing_answer_column_in_json(tmp_path):
    source = tmp_path / "train.json"
    source.write_text(json.dumps(QA_ROWS))
    node = {
        "_component_": "grpo.data.loader.prompt_dataset",
        "source": str(source),
        "prompt_key": "question",
        "answer_key": "solution",
    }
    assert dataset_problems("eval_dataset", node, None) == [
        f"eval_dataset.answer_key: column 'solution' not in {source}; its columns: question, answer"
    ]


def test_missing_column_in_parquet_schema(tmp_path):
    source = str(write_parquet(tmp_path / "train.parquet", QA_ROWS))
    node = {"_component_": PROMPT, "source": source, "prompt_key": "question", "answer_key": "x"}
    assert dataset_problems("dataset", node, None) == [
        f"dataset.answer_key: column 'x' not in {source}; its columns: question, answer"
    ]


def test_gsm8k_columns_are_fixed(tmp_path):
    rows = [{"problem": "What is 1 + 1?", "answer": "#### 2"}]
    source = str(write_jsonl(tmp_path / "gsm8k.jsonl", rows))
    problems = dataset_problems("dataset", {"_component_": GSM8K, "source": source}, None)
    assert problems == [
        f"dataset.source: column 'question' not in {source}; its columns: problem, answer; "
        "gsm8k_dataset needs columns question and answer"
    ]


def test_long_jsonl_is_peeked_at_its_first_rows(tmp_path):
    rows = [*QA_ROWS * 10, {"prompt": "late", "answer": "1"}]
    source = str(write_jsonl(tmp_path / "train.jsonl", rows))
    problems = dataset_problems("dataset", {"_component_": PROMPT, "source": source}, None)
    assert problems == [
        f"dataset.prompt_key: column 'prompt' not in the first 20 rows of {source}; "
        "its columns: question, answer"
    ]


@pytest.mark.parametrize(
    "template", [None, "answer_only", {"_component_": "grpo.data.ThinkAnswerTemplate"}]
)
def test_chat_turns_with_a_plain_template(tmp_path, template):
    source = str(write_jsonl(tmp_path / "train.jsonl", CHAT_ROWS))
    node = {"_component_": PROMPT, "source": source, "prompt_key": "messages"}
    if template is not None:
        node["template"] = template
    problems = dataset_problems("dataset", node, None)
    assert len(problems) == 1
    assert problems[0].startswith(
        "dataset.template: column 'messages' holds chat turns, which the plain template"
    )
    assert "{_component_: grpo.data.ChatTemplate, model_dir: ${base_model_path}}" in problems[0]
    assert "dataset.template._component_=grpo.data.ChatTemplate" in problems[0]
    assert "dataset.template.model_dir=" in problems[0]


def test_chat_turns_in_parquet_with_a_plain_template(tmp_path):
    source = str(write_parquet(tmp_path / "train.parquet", CHAT_ROWS))
    node = {"_component_": PROMPT, "source": source, "prompt_key": "messages"}
    problems = dataset_problems("dataset", node, None)
    assert len(problems) == 1
    assert "holds chat turns" in problems[0]


def test_system_prompt_with_a_plain_template(tmp_path):
    source = str(write_jsonl(tmp_path / "train.jsonl", QA_ROWS))
    node = {"_component_": GSM8K, "source": source, "system_prompt": "Be brief."}
    problems = dataset_problems("dataset", node, None)
    assert len(problems) == 1
    assert problems[0].startswith("dataset.system_prompt: a system prompt is a chat turn")


def test_unknown_template_name(tmp_path):
    source = str(write_jsonl(tmp_path / "train.jsonl", QA_ROWS))
    node = {"_component_": GSM8K, "source": source, "template": "chat"}
    assert dataset_problems("dataset", node, None) == [
        "dataset.template: unknown template 'chat'; expected one of answer_only, think_answer, "
        "or a ChatTemplate node"
    ]


def test_chat_template_folder_without_a_chat_template(tmp_path):
    folder = str(model_folder(tmp_path / "base_model"))
    source = str(write_jsonl(tmp_path / "train.jsonl", CHAT_ROWS))
    node = {
        "_component_": PROMPT,
        "source": source,
        "prompt_key": "messages",
        "template": {**CHAT, "model_dir": folder},
    }
    problems = dataset_problems("dataset", node, None)
    assert len(problems) == 1
    assert problems[0].startswith(
        f"dataset.template.model_dir: {folder} has no chat template (tokenizer_config.json "
        "has no chat_template, no chat_template.jinja)"
    )


def test_chat_template_falls_back_to_base_model_path(tmp_path):
    folder = str(model_folder(tmp_path / "base_model"))
    node = {"_component_": GSM8K, "template": dict(CHAT)}
    problems = dataset_problems("dataset", node, folder)
    assert len(problems) == 1
    assert problems[0].startswith(
        f"dataset.template.model_dir: {folder} (base_model_path) has no chat template"
    )
    # A missing base_model_path folder is reported by the base_model_path check, not here.
    assert dataset_problems("dataset", node, str(tmp_path / "nowhere")) == []


def test_chat_template_missing_model_dir(tmp_path):
    missing = str(tmp_path / "nowhere")
    node = {"_component_": GSM8K, "template": {**CHAT, "model_dir": missing}}
    assert dataset_problems("dataset", node, None) == [
        f"dataset.template.model_dir: model folder {missing} does not exist"
    ]


@pytest.mark.parametrize(
    ("chat_template", "jinja"), [("{{ messages }}", False), (None, True)], ids=["config", "jinja"]
)
def test_good_chat_config(tmp_path, chat_template, jinja):
    folder = str(model_folder(tmp_path / "instruct_model", chat_template, jinja))
    source = str(write_jsonl(tmp_path / "train.jsonl", CHAT_ROWS))
    node = {
        "_component_": PROMPT,
        "source": source,
        "prompt_key": "messages",
        "answer_key": "answer",
        "system_prompt": "Be brief.",
        "template": {**CHAT, "model_dir": folder},
    }
    assert dataset_problems("dataset", node, None) == []


def test_good_plain_configs(tmp_path):
    jsonl = str(write_jsonl(tmp_path / "train.jsonl", QA_ROWS))
    parquet = str(write_parquet(tmp_path / "train.parquet", QA_ROWS))
    for source in (jsonl, parquet):
        node = {"_component_": GSM8K, "source": source, "template": "think_answer"}
        assert dataset_problems("dataset", node, None) == []
        node = {"_component_": PROMPT, "source": source, "prompt_key": "question"}
        assert dataset_problems("dataset", node, None) == []


def test_unreadable_files_are_left_to_the_loader(tmp_path):
    source = tmp_path / "train.parquet"
    source.write_bytes(b"not a parquet file")
    node = {"_component_": PROMPT, "source": str(source)}
    assert dataset_problems("dataset", node, None) == []
    broken = tmp_path / "train.json"
    broken.write_text("[{")
    assert dataset_problems("dataset", {**node, "source": str(broken)}, None) == []


def test_import_and_call_do_not_load_torch(tmp_path):
    check = "import sys, grpo.data; print('torch' in sys.modules)"
    if (
        subprocess.run(
            [sys.executable, "-c", check], capture_output=True, text=True, check=True
        ).stdout.strip()
        == "True"
    ):
        pytest.skip("grpo/data/__init__.py imports torch, so any grpo.data submodule does")
    source = write_jsonl(tmp_path / "train.jsonl", CHAT_ROWS)
    code = textwrap.dedent(
        f"""
        import sys
        from grpo.data.preflight import dataset_problems
        problems = dataset_problems(
            "dataset",
            {{"_component_": "grpo.data.prompt_dataset", "source": {str(source)!r},
              "prompt_key": "messages"}},
            None,
        )
        assert problems, problems
        heavy = sorted({{"torch", "ray", "vllm"}} & set(sys.modules))
        print(",".join(heavy))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""


# Values the arithmetic dataset refuses by its options' declarations, and the key each names.
ARITHMETIC_REFUSALS = [
    ({"num_examples": 0}, "num_examples"),
    ({"num_examples": 2.5}, "num_examples"),
    ({"split": "dev"}, "split"),
    ({"test_fraction": 1.5}, "test_fraction"),
    ({"test_fraction": 0}, "test_fraction"),
]


# Arguments the arithmetic dataset refuses together (`arithmetic_problem`), and the key named.
ARITHMETIC_RELATION_REFUSALS = [
    ({"min_value": 200}, "min_value: 200 is above max_value"),
    ({"operations": ["/"]}, "operations: unsupported value"),
    ({"operations": []}, "operations: must not be empty"),
    ({"operand_digits": {5: 1}}, "operand_digits: {5: 1} has no digit count"),
]


@pytest.mark.parametrize("kwargs,message", ARITHMETIC_RELATION_REFUSALS, ids=repr)
def test_validate_refuses_the_arguments_the_dataset_refuses_together(kwargs, message):
    from grpo.config import ConfigError, compose_config
    from grpo.data import arithmetic_dataset
    from grpo.preflight import validate_run_config

    with pytest.raises(ValueError, match=re.escape(message)):
        arithmetic_dataset(**kwargs)
    overrides = [f"dataset.{name}={value}" for name, value in kwargs.items()]
    with pytest.raises(ConfigError, match=re.escape(f"dataset.{message}")):
        validate_run_config(compose_config("tiny_arithmetic_cpu", overrides))


@pytest.mark.parametrize("kwargs,key", ARITHMETIC_REFUSALS, ids=repr)
def test_validate_refuses_what_the_dataset_refuses(kwargs, key):
    """A dataset option the factory would refuse in a collector, after Ray started, is
    refused by `grpo validate` first, from the same declaration."""
    from grpo.config import ConfigError, compose_config
    from grpo.data import arithmetic_dataset
    from grpo.preflight import validate_run_config

    with pytest.raises(ValueError, match=f"arithmetic_dataset: {key}: expected"):
        arithmetic_dataset(**kwargs)
    overrides = [f"dataset.{name}={value}" for name, value in kwargs.items()]
    with pytest.raises(ConfigError, match=f"dataset.{key}: expected"):
        validate_run_config(compose_config("tiny_arithmetic_cpu", overrides))


def test_validate_refuses_what_the_file_and_hub_datasets_refuse(tmp_path):
    from grpo.config import ConfigError, compose_config
    from grpo.data import gsm8k_dataset, prompt_dataset
    from grpo.preflight import validate_run_config

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "1 + 1?", "answer": "2"}) + "\n")
    for factory in (prompt_dataset, gsm8k_dataset):
        with pytest.raises(ValueError, match="num_examples: expected an int >= 1 or null, got 0"):
            factory(str(path), num_examples=0)
        node = f"{{_component_: grpo.data.{factory.__name__}, source: {path}, num_examples: 0}}"
        with pytest.raises(ConfigError, match="dataset.num_examples: expected an int >= 1"):
            validate_run_config(compose_config("tiny_arithmetic_cpu", [f"dataset={node}"]))
