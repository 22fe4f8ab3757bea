"""Whole runs on verifiers environments: a single-turn and a tool-using taskset, 2 steps each.

The collector serves its vLLM engine on the token-in, token-out endpoint; verifiers' client
renders the prompts (the tool taskset's system turn lists the ``add`` tool, served over MCP by
a process of its own) and the trajectories trained are the trace's tokens. The run has no
``dataset``: the taskset's rows are the data.
"""

from __future__ import annotations

import pytest

pytest.importorskip("verifiers", reason="the verifiers extra: pip install -e '.[verifiers]'")

from grpo.cli import main as grpo_main  # noqa: E402
from grpo.observability.metric_names import (
    INFERENCE_EPISODES_DROPPED,
    INFERENCE_EPISODES_DROPPED_TOTAL,
)
from grpo.testing import RANDOM_MODEL_OVERRIDES, read_jsonl  # noqa: E402
from grpo.testing.tiny_models import build_tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    """A tiny Qwen2 folder whose tokenizer has Qwen2.5's tool tokens and template."""
    return build_tiny_qwen2(tmp_path_factory.mktemp("tool_model") / "model", tool_calls=True)


@pytest.mark.parametrize(
    "taskset", ["grpo.testing.verifiers_arithmetic", "grpo.testing.verifiers_add_tool"]
)
def test_two_steps_on_a_verifiers_environment(
    taskset, tool_model_dir, tmp_path, monkeypatch, ray_shared
):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_dir = tmp_path / "run"
    status = grpo_main(
        [
            "run",
            "async_grpo",
            "--config",
            "tiny_arithmetic_cpu",
            f"base_model_path={tool_model_dir}",
            *RANDOM_MODEL_OVERRIDES,
            f"output_dir={run_dir}",
            "orchestration.num_steps=2",
            "eval_every_n_steps=null",
            "dataset=null",
            f"environment={{_component_: grpo.envs.verifiers_env, taskset: {taskset}, "
            "max_turns: 3}",
            "inference.engine_args.max_model_len=512",
            "inference.batch_size=4",
            "inference.group_size=4",
            "training.batch_size=16",
        ]
    )
    assert status == 0

    trained = [sid for r in read_jsonl(run_dir / "trained.jsonl") for sid in r["sequence_ids"]]
    assert len(trained) == len(set(trained)) == 2 * 16
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    batches = [r for r in metrics if INFERENCE_EPISODES_DROPPED in r]
    assert batches and all(r[INFERENCE_EPISODES_DROPPED_TOTAL] == 0 for r in batches)
    # The prompts are the taskset's as the client rendered them: the tool taskset's list the
    # tool's schema in a system turn, several times longer than the question alone.
    prompt_tokens = batches[0]["inference/prompt_tokens"] / 4
    assert prompt_tokens > (100 if taskset.endswith("add_tool") else 10)
    # The trainer's logprobs of the trained tokens are the engine's: the tokens are the same.
    mismatch = [r["training/mismatch_kl"] for r in metrics if "training/mismatch_kl" in r]  # fmt: skip
    assert mismatch and max(mismatch) < 1e-3
    assert (run_dir / "final" / "model.safetensors").exists()
