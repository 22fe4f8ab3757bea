"""``scripts/bench_trainer_mfu.py``: its FLOP count, and a whole run on a tiny shape on CPU;
``scripts/bench_flex_lengths.py`` (CUDA only) refusing a CPU."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers.scripts import SCRIPTS, load_script

SCRIPT = SCRIPTS / "bench_trainer_mfu.py"


def test_model_flops_counts_linear_layers_response_logits_and_attended_pairs():
    script = load_script("bench_trainer_mfu")
    from bench_common import scored_groups

    shape = dict(
        num_layers=2,
        embed_dim=8,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        intermediate_dim=16,
        vocab_size=10,
    )
    # One prompt of 3 tokens, shared by two responses of 2: 3 + 2 + 2 tokens in the pack.
    batch = scored_groups(1, 2, prompt_len=3, response_len=2, vocab_size=10)
    per_layer = 8 * 4 * (2 * 2 + 2 * 1) + 3 * 8 * 16  # q, o; k, v; gate, up, down
    linear = 6 * 2 * per_layer * 7 + 6 * 10 * 8 * 4  # the output projection: 4 response tokens
    pairs = 6 + 2 * (3 * 2 + 3)  # the prompt causally; each response: the prompt, then causal
    attention = 12 * 2 * 2 * 4 * pairs
    assert script.model_flops(shape, batch) == linear + attention
    # LoRA: frozen weights get no gradient, 4 x instead of 6 x; attention is the same.
    assert script.model_flops(shape, batch, lora=True) == linear * 4 // 6 + attention


def test_a_tiny_run_prints_tokens_per_second_and_mfu_for_each_setting():
    command = [sys.executable, str(SCRIPT), "--shape", "tiny", "--compile", "off"]
    command += ["--fused-adamw", "both"]
    command += ["--tokens", "256", "--groups", "2", "--group-size", "2", "--prompt-len", "32"]
    command += ["--response-len", "24", "--warmup", "1", "--steps", "2", "--peak-size", "512"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    number = r"\s+([\d.,]+)"
    rows = re.findall(rf"^\s+compile off, AdamW (\w+){number * 6}%$", result.stdout, re.M)
    assert [row[0] for row in rows] == ["foreach", "fused"], result.stdout
    for _, first, median, slowest, tokens_per_s, _, mfu in rows:
        # 2 prompts of 32 and 4 responses of 24: 160 tokens a step; two timed steps, so the
        # median is their mean. The median is printed to the millisecond.
        tokens = float(tokens_per_s.replace(",", ""))
        assert 160 / (float(median) + 0.0005) - 1 <= tokens <= 160 / (float(median) - 0.0005) + 1
        assert float(median) <= float(slowest) and float(first) >= 0
        assert 0.0 < float(mfu) < 100.0


def test_varied_lengths_are_counted_per_batch():
    command = [sys.executable, str(SCRIPT), "--shape", "tiny", "--compile", "off"]
    command += ["--tokens", "512", "--groups", "2", "--group-size", "2", "--prompt-len", "32"]
    command += ["--response-len", "24", "--spread", "4", "--batches", "3", "--peak-size", "512"]
    command += ["--warmup", "0", "--steps", "3"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    low, high = map(int, re.search(r"(\d+)-(\d+) tokens in a pack of 512", result.stdout).groups())
    assert low < high, result.stdout  # the three batches differ in length


def test_the_flex_lengths_benchmark_says_it_needs_cuda():
    """``scripts/bench_flex_lengths.py`` times FlexAttention's backward, which runs on CUDA
    only: without a GPU it stops with one line before building anything."""
    command = [sys.executable, str(SCRIPTS / "bench_flex_lengths.py"), "--packs", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "bench_flex_lengths.py needs a CUDA device (FlexAttention's backward)"
    )
