"""The shipped demo model (``assets/tiny_arithmetic_qwen2``): it loads, and it is partly competent.

The CPU demo needs a starting policy that writes ``<answer>N</answer>`` and stops but gets only
some answers right, so that GRPO has visible headroom. These tests pin that down on the demo
config's own held-out set: greedy accuracy inside `ACCURACY_RANGE`, format nearly always right,
in torchtune and (slow) in vLLM, which is what the demo's evaluator runs.
"""

from __future__ import annotations

import gc
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch

from grpo.config import instantiate, load_config, repo_root
from grpo.models import build_model, load_hf_config, load_tokenizer
from grpo.rewards import FormatReward, MathCorrectnessReward
from grpo.testing import set_vllm_cpu_env, tiny_vllm_engine_kwargs

MODEL_DIR = repo_root() / "assets" / "tiny_arithmetic_qwen2"
BUILD_SCRIPT = repo_root() / "scripts" / "build_tiny_arithmetic_model.py"
CONFIG_NAME = "tiny_arithmetic_cpu"
# Greedy held-out accuracy of the shipped model on the demo's eval set. The build script's 700
# supervised steps give ~17% on other held-out questions; this band leaves room for the
# difference between question sets and between torchtune and vLLM greedy decoding.
ACCURACY_RANGE = (0.10, 0.26)
# The folder ships in the repository: keep it small.
MAX_FOLDER_BYTES = 8 * 2**20


def load_build_script() -> ModuleType:
    """``scripts/build_tiny_arithmetic_model.py`` as a module (``scripts/`` is no package)."""
    spec = importlib.util.spec_from_file_location("build_tiny_arithmetic_model", BUILD_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def eval_items() -> list[dict[str, str]]:
    """The held-out examples the demo evaluates on, exactly as the demo's evaluator picks them."""
    cfg = load_config(CONFIG_NAME)
    dataset = instantiate(cfg.eval_dataset)
    limit = min(cfg.eval_num_examples or len(dataset), len(dataset))
    return [dataset[i] for i in range(limit)]


def accuracy_and_format(completions: list[str], items: list[dict[str, str]]) -> tuple[float, float]:
    """Share of correct answers (math-verify, as the demo scores) and of well-formed responses."""
    correctness = MathCorrectnessReward(partial_credit=0.0)
    answer_format = FormatReward(think_required=False)
    correct = sum(correctness(c, item["answer"]).success for c, item in zip(completions, items))
    # The format reward sees what the reference actor decodes: special tokens dropped.
    formatted = sum(
        answer_format(c.removesuffix("<|im_end|>"), item["answer"]).success
        for c, item in zip(completions, items)
    )
    return correct / len(items), formatted / len(items)


def test_folder_is_a_small_qwen2_checkpoint() -> None:
    config = load_hf_config(MODEL_DIR)
    assert config["model_type"] == "qwen2"
    # vLLM's CPU attention needs a head dim of 64.
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    for name in ("config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer.json"):
        assert (MODEL_DIR / name).is_file(), name
    folder_bytes = sum(path.stat().st_size for path in MODEL_DIR.iterdir() if path.is_file())
    assert folder_bytes <= MAX_FOLDER_BYTES


def test_demo_config_points_at_the_shipped_model() -> None:
    cfg = load_config(CONFIG_NAME)
    assert Path(cfg.base_model_path).resolve() == MODEL_DIR.resolve()


def test_torchtune_greedy_accuracy_in_range(eval_items: list[dict[str, str]]) -> None:
    build_script = load_build_script()
    tokenizer = load_tokenizer(MODEL_DIR)
    model = build_model(MODEL_DIR).eval()
    prompts = [tokenizer.encode(item["prompt"], add_bos=True, add_eos=False) for item in eval_items]
    completions = build_script.greedy_completions(model, prompts, tokenizer)

    accuracy, format_rate = accuracy_and_format(completions, eval_items)
    assert ACCURACY_RANGE[0] <= accuracy <= ACCURACY_RANGE[1], accuracy
    # The format is learned: what is left to learn is arithmetic.
    assert format_rate >= 0.95, format_rate
    # ... and the response ends right after the answer, with the EOS token.
    closed = [re.fullmatch(r"<answer>[^<]*</answer><\|im_end\|>", c) for c in completions]
    assert sum(match is not None for match in closed) >= 0.95 * len(completions)


@pytest.mark.slow
def test_vllm_greedy_accuracy_in_range(eval_items: list[dict[str, str]]) -> None:
    set_vllm_cpu_env()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = load_tokenizer(MODEL_DIR)
    prompts = [tokenizer.encode(item["prompt"], add_bos=True, add_eos=False) for item in eval_items]
    llm = LLM(model=str(MODEL_DIR), **tiny_vllm_engine_kwargs(max_model_len=128))
    try:
        # The demo evaluator's sampling: greedy, stop after "</answer>" or a stop token.
        params = SamplingParams(
            n=1,
            max_tokens=24,
            temperature=0.0,
            stop=["</answer>"],
            include_stop_str_in_output=True,
            stop_token_ids=list(tokenizer.stop_tokens),
        )
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False
        )
        completions = [
            tokenizer.decode(list(out.outputs[0].token_ids), skip_special_tokens=True)
            for out in outputs
        ]
    finally:
        del llm
        gc.collect()

    accuracy, format_rate = accuracy_and_format(completions, eval_items)
    assert ACCURACY_RANGE[0] <= accuracy <= ACCURACY_RANGE[1], accuracy
    assert format_rate >= 0.95, format_rate
    # vLLM and torchtune compute the same model: greedy answers agree on almost every prompt.
    model = build_model(MODEL_DIR).eval()
    with torch.no_grad():
        tune_completions = load_build_script().greedy_completions(model, prompts, tokenizer)
    tune_answers = [c.replace("<|im_end|>", "") for c in tune_completions]
    agree = sum(a == b for a, b in zip(completions, tune_answers))
    assert agree >= 0.95 * len(prompts), agree
