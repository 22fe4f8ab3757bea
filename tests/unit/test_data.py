"""Datasets, templates, prompt-length filtering and the sharded prompt stream."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo.data import (
    AnswerOnlyTemplate,
    PromptDataset,
    PromptStream,
    SkipReport,
    ThinkAnswerTemplate,
    arithmetic_dataset,
    extract_gsm8k_answer,
    filter_long_prompts,
    gsm8k_dataset,
    question_split,
    resolve_template,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
QUESTION = re.compile(r"What is (\(-\d+\)|\d+) ([-+*]) (\(-\d+\)|\d+)\?")


def _operands(question: str) -> tuple[int, str, int]:
    match = QUESTION.fullmatch(question)
    assert match is not None, question
    left, op, right = match.groups()
    return int(left.strip("()")), op, int(right.strip("()"))


# ---------------------------------------------------------------- arithmetic


def test_arithmetic_is_deterministic_given_seed():
    first = arithmetic_dataset(num_examples=500, seed=3)
    again = arithmetic_dataset(num_examples=500, seed=3)
    other = arithmetic_dataset(num_examples=500, seed=4)
    assert first.examples == again.examples
    assert first.examples != other.examples


@pytest.mark.parametrize("min_value,max_value", [(0, 99), (-20, 20), (0, 999)])
def test_arithmetic_answers_are_correct(min_value, max_value):
    dataset = arithmetic_dataset(
        num_examples=1000, seed=0, min_value=min_value, max_value=max_value
    )
    # Evaluate the question text as a Python expression: it is independent of the generator's
    # own arithmetic, and checks that negative operands are written unambiguously.
    for example in dataset.examples:
        left, _, right = _operands(example["question"])
        assert min_value <= left <= max_value and min_value <= right <= max_value
        expression = example["question"].removeprefix("What is ").removesuffix("?")
        assert example["answer"] == str(eval(expression, {"__builtins__": {}}))
    if min_value < 0:
        assert any("(-" in example["question"] for example in dataset.examples)


def test_arithmetic_train_and_test_are_disjoint():
    train = arithmetic_dataset(num_examples=5000, seed=0, split="train")
    test = arithmetic_dataset(num_examples=1000, seed=1, split="test")
    train_questions = {example["question"] for example in train.examples}
    test_questions = {example["question"] for example in test.examples}
    assert train_questions.isdisjoint(test_questions)
    assert all(question_split(q, 0.1) == "train" for q in train_questions)
    assert all(question_split(q, 0.1) == "test" for q in test_questions)
    # The test share of the question space is roughly test_fraction.
    every_sum = [f"What is {a} + {b}?" for a in range(100) for b in range(100)]
    test_share = sum(question_split(q, 0.1) == "test" for q in every_sum) / len(every_sum)
    assert 0.08 < test_share < 0.12


def test_arithmetic_mixes_operations_and_sizes():
    dataset = arithmetic_dataset(num_examples=3000, seed=0)
    parsed = [_operands(example["question"]) for example in dataset.examples]
    operation_counts = Counter(op for _, op, _ in parsed)
    assert set(operation_counts) == {"+", "-", "*"}
    assert all(count > 800 for count in operation_counts.values()), operation_counts
    digit_pairs = Counter((len(str(left)), len(str(right))) for left, _, right in parsed)
    assert set(digit_pairs) == {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert all(count > 500 for count in digit_pairs.values()), digit_pairs
    assert any(int(example["answer"]) < 0 for example in dataset.examples)


def test_arithmetic_weights_and_unique():
    only_sums = arithmetic_dataset(
        num_examples=200, operations={"+": 1.0, "*": 0.0}, operand_digits={1: 1.0}
    )
    assert {_operands(e["question"])[1] for e in only_sums.examples} == {"+"}
    assert all(len(e["question"]) == len("What is 1 + 2?") for e in only_sums.examples)
    unique = arithmetic_dataset(num_examples=2000, seed=0, unique=True)
    assert len({e["question"] for e in unique.examples}) == 2000
    # 1-digit sums: 100 questions, about 10 of them in the test split.
    with pytest.raises(ValueError, match="distinct 'test' questions"):
        arithmetic_dataset(
            num_examples=50, operations=("+",), max_value=9, split="test", unique=True
        )


def test_arithmetic_rejects_bad_arguments():
    with pytest.raises(ValueError, match="'/'"):
        arithmetic_dataset(num_examples=10, operations=("+", "/"))
    with pytest.raises(ValueError, match="split"):
        arithmetic_dataset(num_examples=10, split="validation")
    with pytest.raises(ValueError, match="operand_digits"):
        arithmetic_dataset(num_examples=10, max_value=9, operand_digits={3: 1.0})


def test_arithmetic_template_option():
    assert isinstance(arithmetic_dataset(num_examples=5).template, AnswerOnlyTemplate)
    by_name = arithmetic_dataset(num_examples=5, template="think_answer")
    assert isinstance(by_name.template, ThinkAnswerTemplate)
    by_component = arithmetic_dataset(
        num_examples=5,
        template={"_component_": "grpo.data.ThinkAnswerTemplate", "instruction": "Think."},
    )
    assert by_component[0]["prompt"].startswith("Think.\nUser: What is ")


# ---------------------------------------------------------------- gsm8k

GOOD_ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A car costs $1,234.", "answer": "It costs 1,234 dollars.\n#### 1,234"},
    {"question": "Lost 5 from 0.", "answer": "0 - 5 = -5\n#### -5"},
]
BAD_ROWS = [
    ({"question": "   ", "answer": "#### 1"}, "empty question"),
    ({"question": "No answer here?"}, "missing answer"),
    ({"question": "Why?", "answer": "Because 72."}, "answer has no '#### <number>' final answer"),
    ({"question": 12, "answer": "#### 12"}, "question is not a string (int)"),
]


def _mixed_rows() -> tuple[list[dict], dict[int, str]]:
    """Rows interleaving good and bad ones; returns them and {1-based row: reason}."""
    rows, reasons = [], {}
    for good, (bad, reason) in zip(GOOD_ROWS + [GOOD_ROWS[0]], BAD_ROWS):
        rows.append(good)
        rows.append(bad)
        reasons[len(rows)] = reason
    return rows, reasons


def _expected_answers() -> list[str]:
    return ["7", "1234", "-5", "7"]


def test_extract_gsm8k_answer():
    assert extract_gsm8k_answer("so 1,000 + 234 = 1,234\n#### 1,234") == "1234"
    assert extract_gsm8k_answer("#### 72") == "72"
    assert extract_gsm8k_answer("#### -3.5") == "-3.5"
    assert extract_gsm8k_answer("#### $1,000,000.") == "1000000"
    assert extract_gsm8k_answer("#### 1\nwait\n#### 2") == "2"
    assert extract_gsm8k_answer("The answer is 72.") is None
    assert extract_gsm8k_answer("#### seventy-two") is None


def test_gsm8k_from_jsonl_skips_and_counts_bad_rows(tmp_path):
    rows, reasons = _mixed_rows()
    path = tmp_path / "train.jsonl"
    lines = [json.dumps(row) for row in rows] + ["{not json", ""]
    path.write_text("\n".join(lines) + "\n")

    dataset = gsm8k_dataset(source=str(path))
    assert [e["answer"] for e in dataset.examples] == _expected_answers()
    assert dataset.examples[0]["question"] == GOOD_ROWS[0]["question"]
    assert dataset.rows == [1, 3, 5, 7]
    assert dataset.skipped.count == len(BAD_ROWS) + 1
    assert dataset.skipped.examples[: len(BAD_ROWS)] == sorted(reasons.items())
    bad_json_row, bad_json_reason = dataset.skipped.examples[-1]
    assert bad_json_row == len(rows) + 1 and bad_json_reason.startswith("not valid JSON")
    summary = dataset.skipped.summary()
    assert summary.startswith(f"skipped 5 rows of {path}: row 2: empty question; row 4: ")
    assert isinstance(dataset.template, ThinkAnswerTemplate)
    assert GOOD_ROWS[0]["question"] in dataset[0]["prompt"]


def test_gsm8k_from_parquet_and_json(tmp_path):
    rows, reasons = _mixed_rows()
    parquet_rows = [row for row in rows if isinstance(row.get("question", ""), str)]
    parquet_path = tmp_path / "train.parquet"
    table = pa.Table.from_pylist(
        [{"question": r.get("question"), "answer": r.get("answer")} for r in parquet_rows]
    )
    pq.write_table(table, parquet_path)
    from_parquet = gsm8k_dataset(source=str(parquet_path), template="answer_only")
    assert [e["answer"] for e in from_parquet.examples] == _expected_answers()
    assert from_parquet.skipped.examples == [
        (2, "empty question"),
        (4, "missing answer"),
        (6, "answer has no '#### <number>' final answer"),
    ]
    assert from_parquet[1]["prompt"] == GOOD_ROWS[1]["question"] + "\n"

    json_path = tmp_path / "train.json"
    json_path.write_text(json.dumps(rows))
    from_json = gsm8k_dataset(source=str(json_path))
    assert [e["answer"] for e in from_json.examples] == _expected_answers()
    assert from_json.skipped.examples == sorted(reasons.items())


def test_gsm8k_report_keeps_only_the_first_rows(tmp_path):
    path = tmp_path / "many_bad.jsonl"
    rows = [GOOD_ROWS[0]] + [{"question": f"q{i}", "answer": "no final"} for i in range(10)]
    path.write_text("\n".join(json.dumps(row) for row in rows))
    dataset = gsm8k_dataset(source=str(path), max_skipped_examples=2)
    assert dataset.skipped.count == 10
    assert [row for row, _ in dataset.skipped.examples] == [2, 3]
    assert dataset.skipped.summary().endswith("; ... (8 more)")


def test_gsm8k_file_errors(tmp_path):
    missing = tmp_path / "nowhere" / "train.jsonl"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        gsm8k_dataset(source=str(missing))
    csv_path = tmp_path / "train.csv"
    csv_path.write_text("question,answer\nq,#### 1\n")
    with pytest.raises(ValueError, match=r"unsupported GSM8K file extension '\.csv'"):
        gsm8k_dataset(source=str(csv_path))
    wrong_columns = tmp_path / "wrong.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "q", "solution": "#### 1"}]), wrong_columns)
    with pytest.raises(ValueError, match="'question'.*'problem'"):
        gsm8k_dataset(source=str(wrong_columns))
    all_bad = tmp_path / "bad.jsonl"
    all_bad.write_text(json.dumps({"question": "", "answer": "#### 1"}) + "\n")
    with pytest.raises(ValueError, match="no usable GSM8K rows.*row 1: empty question"):
        gsm8k_dataset(source=str(all_bad))


def test_gsm8k_hub_name_offline_fails_clearly(tmp_path):
    # In a subprocess: the offline switches are read when `datasets` is first imported, and an
    # earlier test in the same process may already have imported it.
    script = textwrap.dedent(
        """
        from grpo.data import gsm8k_dataset
        try:
            gsm8k_dataset(source="openai/gsm8k", split="train")
        except Exception as error:
            print(type(error).__name__)
            print(error)
        else:
            print("loaded")
        """
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf_home"),  # an empty cache: nothing to fall back on
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    error_type, message = result.stdout.split("\n", 1)
    try:
        import datasets  # noqa: F401

        assert error_type == "RuntimeError"
    except ImportError:
        assert error_type == "ImportError"
    assert "'openai/gsm8k'" in message
    assert "local .parquet, .jsonl or .json file" in message


# ---------------------------------------------------------------- templates


def test_answer_only_template_exact_text():
    template = AnswerOnlyTemplate()
    assert template("What is 37 + 48?") == "What is 37 + 48?\n"
    assert template.target("85") == "<answer>85</answer>"
    assert resolve_template("answer_only", default="think_answer")("What is 1 + 1?") == (
        "What is 1 + 1?\n"
    )


def test_think_answer_template_contains_instruction_and_question():
    question = "Natalia sold 48 clips in April. How many in May?"
    plain = ThinkAnswerTemplate()(question)
    assert "<think>" in plain and "</think>" in plain and "<answer>" in plain
    assert plain.index("<answer>") < plain.index(question)
    assert plain.endswith(f"User: {question}\nAssistant:")
    template = ThinkAnswerTemplate()
    assert "<think>" in template.instruction and "<answer>" in template.instruction
    assert template.target("72", "48 / 2 = 24").endswith("</think>\n<answer>72</answer>")
    with pytest.raises(TypeError, match="chat turns need a chat template: grpo.data.ChatTemplate"):
        template([{"role": "user", "content": question}])


def test_resolve_template_errors():
    with pytest.raises(ValueError, match="unknown template 'r1'.*answer_only"):
        resolve_template("r1", default="answer_only")
    with pytest.raises(ValueError, match="grpo.data.NoSuchTemplate"):
        resolve_template({"_component_": "grpo.data.NoSuchTemplate"}, default="answer_only")
    with pytest.raises(TypeError, match="int"):
        resolve_template(3, default="answer_only")


# ---------------------------------------------------------------- filter_long_prompts


def test_filter_long_prompts_skips_and_counts(tmp_path):
    path = tmp_path / "mixed.jsonl"
    rows = [
        {"question": "short one", "answer": "#### 1"},
        {"question": "", "answer": "#### 2"},
        {"question": "a much longer question with many words in it", "answer": "#### 3"},
        {"question": "two words", "answer": "#### 4"},
    ]
    path.write_text("\n".join(json.dumps(row) for row in rows))
    dataset = gsm8k_dataset(source=str(path), template="answer_only")

    def count_words(text: str) -> list[int]:  # a stand-in tokenizer: one token per word
        return list(range(len(text.split())))

    short = filter_long_prompts(dataset, count_words, max_prompt_tokens=3)
    assert [e["answer"] for e in short.examples] == ["1", "4"]
    assert short.rows == [1, 4]
    assert short.skipped.count == 2
    assert short.skipped.examples == [
        (2, "empty question"),
        (3, "prompt has 9 tokens > max_prompt_tokens=3"),
    ]
    assert len(dataset) == 3 and dataset.skipped.count == 1  # the input is left as it was
    with pytest.raises(ValueError, match="all 3 prompts are longer than max_prompt_tokens=1"):
        filter_long_prompts(dataset, count_words, max_prompt_tokens=1)


def test_skip_report_and_dataset_validation():
    report = SkipReport("x.jsonl", max_examples=1)
    assert report.summary() == "skipped 0 rows of x.jsonl"
    report.add(4, "empty question")
    assert report.summary() == "skipped 1 row of x.jsonl: row 4: empty question"
    with pytest.raises(ValueError, match="example 1 needs a string 'answer'"):
        PromptDataset(
            [{"question": "a", "answer": "1"}, {"question": "b", "answer": 2}],
            AnswerOnlyTemplate(),
        )


# ---------------------------------------------------------------- PromptStream


def _toy_dataset(size: int) -> list[dict[str, str]]:
    return [{"question": f"q{i}", "answer": str(i)} for i in range(size)]


@pytest.mark.parametrize("num_workers", [2, 3])
def test_stream_shards_are_disjoint_and_cover_one_epoch(num_workers):
    dataset = _toy_dataset(10)
    seen = []
    for worker_id in range(num_workers):
        stream = PromptStream(dataset, worker_id, num_workers, seed=0)
        batch = stream.next_batch(len(stream))
        assert stream.epoch == 1 and stream.position == 0
        indices = [item["index"] for item in batch]
        assert len(set(indices)) == len(indices)
        assert all(item["question"] == f"q{item['index']}" for item in batch)
        seen.append(set(indices))
    assert sorted(len(shard) for shard in seen) == sorted(
        len(range(w, 10, num_workers)) for w in range(num_workers)
    )
    for first in range(num_workers):
        for second in range(first + 1, num_workers):
            assert seen[first].isdisjoint(seen[second])
    assert set().union(*seen) == set(range(10))


@pytest.mark.parametrize("stop_after", [0, 7, 20, 33])
def test_stream_resume_continues_exactly(stop_after):
    dataset = arithmetic_dataset(num_examples=40, seed=0)
    uninterrupted = PromptStream(dataset, worker_id=1, num_workers=2, seed=5)
    expected = uninterrupted.next_batch(stop_after + 45)  # crosses several epochs of 20

    interrupted = PromptStream(dataset, worker_id=1, num_workers=2, seed=5)
    assert interrupted.next_batch(stop_after) == expected[:stop_after]
    saved = json.loads(json.dumps(interrupted.state_dict()))  # survives a checkpoint file
    resumed = PromptStream(dataset, worker_id=1, num_workers=2, seed=5)
    resumed.load_state_dict(saved)
    assert resumed.next_batch(45) == expected[stop_after:]


def test_stream_reshuffles_every_epoch_deterministically():
    dataset = _toy_dataset(60)
    stream = PromptStream(dataset, worker_id=0, num_workers=2, seed=0)
    epochs = [[item["index"] for item in stream.next_batch(30)] for _ in range(3)]
    assert stream.epoch == 3
    assert all(sorted(order) == list(range(0, 60, 2)) for order in epochs)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    same_seed = PromptStream(dataset, worker_id=0, num_workers=2, seed=0)
    assert [item["index"] for item in same_seed.next_batch(90)] == sum(epochs, [])
    other_seed = PromptStream(dataset, worker_id=0, num_workers=2, seed=1)
    assert [item["index"] for item in other_seed.next_batch(30)] != epochs[0]
    in_order = PromptStream(dataset, worker_id=1, num_workers=2, shuffle=False)
    assert [item["index"] for item in in_order.next_batch(31)] == [*range(1, 60, 2), 1]


def test_stream_errors():
    with pytest.raises(ValueError, match="worker 2 of 3 would get an empty shard.*only 2"):
        PromptStream(_toy_dataset(2), worker_id=2, num_workers=3, seed=0)
    with pytest.raises(ValueError, match="worker_id"):
        PromptStream(_toy_dataset(2), worker_id=3, num_workers=3, seed=0)
    saved = PromptStream(_toy_dataset(10), worker_id=0, num_workers=2, seed=0).state_dict()
    with pytest.raises(ValueError, match="num_workers=2 but this stream has num_workers=3"):
        PromptStream(_toy_dataset(10), worker_id=0, num_workers=3, seed=0).load_state_dict(saved)
    with pytest.raises(ValueError, match="position"):
        PromptStream(_toy_dataset(10), 0, 2, seed=0).load_state_dict({**saved, "position": 5})


def test_gsm8k_accepts_a_path_object(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD_ROWS[0]))
    assert gsm8k_dataset(source=path).examples == [
        {"question": GOOD_ROWS[0]["question"], "answer": "7"}
    ]
