"""A whole LoRA run (``training.lora``): adapters synced to vLLM and served as LoRA adapters,
the reference from the base model with the adapter off, adapter-only checkpoints, an exact
resume from one, and its export. The first run time-shares the engine with the trainer (vLLM
sleeps at level 1 while it steps), the resumed one does not: both train the same.

Tiny Qwen2, CPU, the real actors (Ray, vLLM CPU with its LoRA kernels, torchtune).
"""

from pathlib import Path

import pytest
import torch

from grpo.cli import main as grpo_main
from grpo.observability.metric_names import (
    INFERENCE_POLICY_VERSION,
    INFERENCE_TIME_ASLEEP,
    INFERENCE_WEIGHT_UPDATES_REJECTED,
    TRAIN_LOSS,
    TRAIN_MISMATCH_MAX_ABS,
)
from grpo.testing import RANDOM_MODEL_OVERRIDES, read_jsonl

pytestmark = pytest.mark.slow

LORA_RUN = (
    "training.lora={rank: 8, alpha: 16, target_modules: [q_proj, v_proj, o_proj, down_proj]}",
    "training.optimizer.lr=1e-2",
    # A KL term: its reference is the trainer's own model with the adapter off.
    "training.loss.kl_coeff=0.05",
    "orchestration.synchronous=true",
    "training.lr_scheduler=null",
    "checkpoint.save_every_n_steps=2",
    "eval_every_n_steps=null",
    # A reward the random tiny model earns sometimes, so the adapters train.
    "reward_functions=[{_component_: grpo.rewards.TokenPresenceReward, token: '7'}]",
    "ref.reward_weights=null",
)


def run(model_dir: Path, run_dir: Path, *overrides: str) -> None:
    argv = [
        *("run", "async_grpo", "--config", "tiny_arithmetic_cpu"),
        f"base_model_path={model_dir}",
        *RANDOM_MODEL_OVERRIDES,
        f"output_dir={run_dir}",
        "orchestration.num_steps=4",
        *LORA_RUN,
        *overrides,
    ]
    # Ray stays up for the next run (the `ray_shared` fixture ends it): one start-up less.
    assert grpo_main(argv) == 0


def by_step(run_dir: Path, name: str) -> dict[int, float]:
    return {r["step"]: r[name] for r in read_jsonl(run_dir / "metrics.jsonl") if name in r}


def test_a_lora_run_syncs_adapters_sleeps_checkpoints_them_and_resumes_exactly(
    tiny_model_dir, tmp_path, monkeypatch, ray_shared
):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(tiny_model_dir, straight, "inference.sleep_while_training=true")
    assert by_step(straight, INFERENCE_TIME_ASLEEP)  # it slept while the trainer stepped

    # Every step's adapter reached the collector and passed its probe; the engine sampled with
    # exactly the trainer's policy (per-token logprobs agree to float32 noise).
    records = read_jsonl(straight / "metrics.jsonl")
    versions = [r[INFERENCE_POLICY_VERSION] for r in records if INFERENCE_POLICY_VERSION in r]
    # One generation batch (8 prompts x 8) feeds two steps of 32: versions 0, then 2.
    assert versions == [0, 2]
    assert max(by_step(straight, INFERENCE_WEIGHT_UPDATES_REJECTED).values()) == 0
    # Steps 1 and 3 train on their own version's batch (2 and 4 on the one before).
    mismatch = by_step(straight, TRAIN_MISMATCH_MAX_ABS)
    assert mismatch[1] < 1e-4 and mismatch[3] < 1e-4
    assert min(by_step(straight, "training/kl_to_ref").values()) >= 0
    assert max(by_step(straight, "training/kl_to_ref").values()) > 0

    # An adapter-only checkpoint: a PEFT folder and the adapters' training state, no model.
    checkpoint = straight / "checkpoints" / "step_000002"
    assert (checkpoint / "adapter" / "adapter_model.safetensors").is_file()
    assert not (checkpoint / "model").exists()
    model_bytes = (Path(tiny_model_dir) / "model.safetensors").stat().st_size
    trainer_bytes = sum(
        f.stat().st_size for f in (checkpoint / "trainer").rglob("*") if f.is_file()
    )
    assert trainer_bytes < model_bytes / 2

    # Resumed from step 2, awake: steps 3 and 4 train the same episodes to the same losses.
    run(tiny_model_dir, resumed, f"resume_from_checkpoint={checkpoint}")
    straight_records = read_jsonl(straight / "trained.jsonl")
    resumed_records = read_jsonl(resumed / "trained.jsonl")
    assert [r["step"] for r in resumed_records] == [3, 4]
    assert [r["sequence_ids"] for r in resumed_records] == [
        r["sequence_ids"] for r in straight_records[2:]
    ]
    losses, resumed_losses = by_step(straight, TRAIN_LOSS), by_step(resumed, TRAIN_LOSS)
    for step in (3, 4):
        assert resumed_losses[step] == pytest.approx(losses[step], rel=1e-6, abs=1e-9)

    # The final adapter, exported and merged, is the policy the run ended with.
    merged = tmp_path / "merged"
    assert (
        grpo_main(["export", str(straight / "checkpoints" / "latest"), "--merged", str(merged)])
        == 0
    )
    from grpo.models import build_model

    tokens = torch.arange(3, 40)[None]
    with torch.no_grad():
        exported = build_model(merged).eval()(tokens)
        final = build_model(straight / "final").eval()(tokens)
        base = build_model(tiny_model_dir).eval()(tokens)
    assert torch.allclose(exported, final, atol=1e-5)
    assert (exported - base).abs().max() > 1e-3
