"""``scripts/bench_trainer_mfu.py``: its FLOP count, and a whole run on a tiny shape on CPU."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

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
    assert script.model_flops(shape, batch) == linear + 12 * 2 * 2 * 4 * pairs


def test_a_tiny_run_prints_tokens_per_second_and_mfu_for_each_compile_setting():
    command = [sys.executable, str(SCRIPT), "--shape", "tiny", "--compile", "off"]
    command += ["--tokens", "256", "--groups", "2", "--group-size", "2", "--prompt-len", "32"]
    command += ["--response-len", "24", "--warmup", "1", "--steps", "2", "--peak-size", "512"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    row = re.search(r"^\s+off\s+([\d.]+)\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)%$", result.stdout, re.M)
    assert row, result.stdout
    seconds, tokens_per_s, _, mfu = row.groups()
    # 2 prompts of 32 and 4 responses of 24: 160 tokens a step.
    assert float(tokens_per_s.replace(",", "")) == pytest.approx(160 / float(seconds), rel=0.02)
    assert 0.0 < float(mfu) < 100.0
