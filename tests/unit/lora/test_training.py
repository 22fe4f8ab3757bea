"""LoRA training in the trainer (``training.lora``): adapters on a frozen base model.

Only the adapters train, keep optimizer state, are checkpointed and published; the reference
logprobs of the KL term are the trainer's own model with the adapters off; and a resume from an
adapter-only checkpoint is exact. Tiny Qwen2, CPU, fp32, varlen attention. That the update does
not depend on how many FSDP workers share the batch: tests/integration/lora/test_fsdp.py.
"""

import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

from grpo.config import LoRAConfig
from grpo.models import build_model, load_hf_config
from grpo.models.lora import is_adapter_key, load_peft_adapter, peft_adapter_state_dict
from grpo.packing.attention import use_packed_attention
from grpo.packing.logprobs import model_response_logprobs
from grpo.packing.packs import pack_sequences
from grpo.testing import gathered_training_state
from grpo.types import ScoredTrajectory
from grpo.weights.checksum import state_dict_checksum
from grpo.workers.trainer import PyTorchActorModel, TrainingConfig
from grpo.workers.training_checkpoint import ADAPTER_SUBDIR, MODEL_SUBDIR, TRAINER_SUBDIR
from tests.helpers.training_state import assert_same_training_state

TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
LORA = LoRAConfig(rank=4, alpha=8.0, target_modules=TARGETS)
LOSS = {
    "_component_": "grpo.objective.loss.GRPOLoss",
    "epsilon_low": 0.2,
    "epsilon_high": 0.2,
    "kl_coeff": 0.05,
    "kl_estimator": "k3",
    "aggregation": "token_mean",
}
ADAMW = {"_component_": "torch.optim.AdamW", "lr": 2e-2}
# Plain SGD: the adapter change is exactly -lr * gradient.
SGD = {"_component_": "torch.optim.SGD", "lr": 0.5}
TEMPERATURE = 0.7
NUM_LAYERS = 2  # build_tiny_qwen2's default
PEFT_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.lora_[AB]\.weight$"
)


def training_config(optimizer=ADAMW, lr_scheduler=None) -> TrainingConfig:
    return TrainingConfig(
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        loss=LOSS,
        clip_grad_norm=None,
        dtype="fp32",
        mask_kind="varlen",
        lora=LORA,
    )


def trainer_kwargs(model_dir, rank=0, world_size=1, config=None, num_steps=4) -> dict:
    return dict(
        rank=rank,
        world_size=world_size,
        model_dir=str(model_dir),
        num_steps=num_steps,
        target_tokens_per_batch=128,
        pad_token_id=0,
        config=config or training_config(),
        seed=0,
        temperature=TEMPERATURE,
    )


def make_batch(num_sequences: int, seed: int = 0) -> list[ScoredTrajectory]:
    """Groups of 4 answering one prompt, as the reference actor scores them under LoRA:
    ``ref_logprobs`` None (it loads no model; the trainer computes them)."""
    generator = torch.Generator().manual_seed(seed)
    batch = []
    for i in range(num_sequences):
        response_len = int(torch.randint(1, 24, (1,), generator=generator))
        if i % 4:
            prompt = batch[-1].prompt_tokens
        else:
            prompt = torch.randint(0, 300, (int(torch.randint(3, 20, (1,), generator=generator)),))
        batch.append(
            ScoredTrajectory(
                prompt_tokens=prompt,
                response_tokens=torch.randint(0, 300, (response_len,), generator=generator),
                prompt_len=prompt.numel(),
                response_len=response_len,
                logprobs=-torch.rand(response_len, generator=generator) * 6,
                ref_logprobs=None,
                rewards=torch.tensor([float(i % 2)]),
                advantages=torch.randn((), generator=generator),
                successes=torch.tensor([float(i % 2)]),
                answer="1",
                sequence_id=f"s{seed}-{i}",
                group_id=i // 4,
                reward_metadata={"func_names": ["toy"]},
                policy_version=0,
            )
        )
    return batch


def new_trainer(model_dir, **kwargs) -> PyTorchActorModel:
    trainer = PyTorchActorModel(**trainer_kwargs(model_dir, **kwargs))
    trainer.setup()
    return trainer


def trainer_packs(trainer: PyTorchActorModel, batch: list[ScoredTrajectory]) -> list:
    """The packs `train_step` makes of ``batch`` on this (single) trainer."""
    micro_batches, _ = trainer._plan_micro_batches(batch)
    return [
        pack_sequences(mb, trainer.device, 0, mask_kind="varlen", share_prompts=True)
        for mb in micro_batches
    ]


def base_model(model_dir) -> torch.nn.Module:
    model = build_model(model_dir, dtype=torch.float32).eval()
    use_packed_attention(model)
    return model


def test_a_step_trains_only_the_adapters(tiny_model_dir):
    trainer = new_trainer(tiny_model_dir)
    trainable = {n for n, p in trainer.policy.model.named_parameters() if p.requires_grad}
    assert len(trainable) == 2 * NUM_LAYERS * len(TARGETS)
    assert all(is_adapter_key(name) for name in trainable)
    before = trainer.full_state_dict()

    for seed in (0, 1):  # the first step moves lora_b only (lora_a's gradient is B^T ... = 0)
        metrics = trainer.train_step(make_batch(8, seed=seed))
    assert metrics["training_perf/time_reference_forward"] > 0
    after = trainer.full_state_dict()
    assert after.keys() == before.keys()
    for name, start in before.items():
        if is_adapter_key(name):
            assert not torch.equal(after[name], start), f"adapter {name} did not train"
        else:
            assert torch.equal(after[name], start), f"base weight {name} changed"

    # The optimizer holds (and keeps state for) the adapters alone.
    name_of = {id(p): n for n, p in trainer.policy.model.named_parameters()}
    optimized = [
        name_of[id(p)] for group in trainer.optimizer.param_groups for p in group["params"]
    ]
    assert sorted(optimized) == sorted(trainable)
    assert sorted(name_of[id(p)] for p in trainer.optimizer.state) == sorted(trainable)


def test_reference_logprobs_are_the_base_models(tiny_model_dir):
    """After the adapters moved, the trainer's reference logprobs (adapters off) are those
    of the base model built on its own, and the loss's KL term is taken against them."""
    trainer = new_trainer(tiny_model_dir)
    for seed in (1, 2, 3):
        trainer.train_step(make_batch(8, seed=seed))
    batch = make_batch(12, seed=4)
    packs = trainer_packs(trainer, batch)
    assert len(packs) >= 2
    reference = trainer._reference_logprobs(packs, len(packs))
    base = base_model(tiny_model_dir)
    policy, expected = [], []
    with torch.no_grad():
        for packed, ref in zip(packs, reference):
            expected.append(model_response_logprobs(base, packed, temperature=TEMPERATURE))
            torch.testing.assert_close(ref, expected[-1], rtol=0, atol=1e-5)
            policy.append(trainer.policy(packed, TEMPERATURE))
    pi, ref = torch.cat(policy), torch.cat(expected)
    assert float((pi - ref).abs().max()) > 1e-3, "the adapters changed nothing"

    # k3 token mean of KL(pi || ref): the step's kl_to_ref, before its update.
    log_ratio = ref - pi
    expected_kl = float((log_ratio.exp() - log_ratio - 1).mean())
    metrics = trainer.train_step(batch)
    assert metrics["training/kl_to_ref"] == pytest.approx(expected_kl, rel=1e-4)


def test_publish_sends_only_the_peft_named_adapter(tiny_model_dir):
    trainer = new_trainer(tiny_model_dir)
    trainer.train_step(make_batch(8))
    payload = trainer.publish_weights("object_store")
    weights = payload["weights"]
    if not isinstance(weights, dict):  # a Ray cluster of this session runs: an object ref
        import ray

        weights = ray.get(weights)
    assert len(weights) == 2 * NUM_LAYERS * len(TARGETS)
    assert all(PEFT_NAME.match(name) for name in weights), sorted(weights)[:4]
    hf_config = load_hf_config(tiny_model_dir)
    expected = peft_adapter_state_dict(trainer.adapter_state_dict(), hf_config)
    torch.testing.assert_close(weights, expected, rtol=0, atol=0)
    assert payload["version"] == trainer.policy_version == 1
    assert payload["checksum"] == state_dict_checksum(weights) == trainer.weights_checksum()

    # The probe is the model's with the adapters on, as the collectors serve it.
    probe = torch.tensor(payload["probe"]["logprobs"])
    torch.testing.assert_close(torch.tensor(trainer.probe_logprobs()["logprobs"]), probe)
    from torchtune.modules.peft import disable_adapter

    with disable_adapter(trainer.policy.model):
        base_probe = torch.tensor(trainer.probe_logprobs()["logprobs"])
    assert float((probe - base_probe).abs().max()) > 1e-4


def test_the_hf_checkpoint_is_the_merged_model(tiny_model_dir, tmp_path):
    trainer = new_trainer(tiny_model_dir)
    for seed in (0, 1):
        trainer.train_step(make_batch(8, seed=seed))
    trainer.save_hf_checkpoint(str(tmp_path / "final"))
    merged = base_model(tmp_path / "final")
    assert not any(is_adapter_key(name) for name in merged.state_dict())
    with torch.no_grad():
        for packed in trainer_packs(trainer, make_batch(8, seed=2)):
            torch.testing.assert_close(
                model_response_logprobs(merged, packed, temperature=TEMPERATURE),
                trainer.policy(packed, TEMPERATURE),
                rtol=0,
                atol=1e-5,
            )


def test_resume_from_an_adapter_only_checkpoint_is_exact(tiny_model_dir, tmp_path):
    """2 steps, save, 2 more steps; a fresh trainer resumed from the save trains the same 2
    batches to the same adapters, AdamW moments and LR schedule, bit for bit."""
    config = training_config(
        lr_scheduler={
            "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "num_warmup_steps": 1,
        }
    )
    batches = [make_batch(8, seed=seed) for seed in range(4)]
    checkpoint = tmp_path / "step_2"
    checkpoint.mkdir()

    straight = new_trainer(tiny_model_dir, config=config)
    for batch in batches[:2]:
        straight.train_step(batch)
    straight.save_checkpoint(str(checkpoint))
    saved_adapter = straight.adapter_state_dict()
    for batch in batches[2:]:
        straight.train_step(batch)
    expected = gathered_training_state(straight)

    # The checkpoint: a PEFT adapter folder and the adapters' training state, no base weights.
    assert not (checkpoint / MODEL_SUBDIR).exists()
    tensors, adapter_config = load_peft_adapter(checkpoint / ADAPTER_SUBDIR)
    hf_config = load_hf_config(tiny_model_dir)
    torch.testing.assert_close(
        tensors, peft_adapter_state_dict(saved_adapter, hf_config), rtol=0, atol=0
    )
    assert adapter_config["r"] == LORA.rank and adapter_config["lora_alpha"] == LORA.alpha
    assert adapter_config["base_model_name_or_path"] == str(tiny_model_dir)
    saved = dcp.FileSystemReader(str(checkpoint / TRAINER_SUBDIR)).read_metadata()
    tensor_keys = [key for key in saved.state_dict_metadata if key.startswith("model.")]
    assert len(tensor_keys) == 2 * NUM_LAYERS * len(TARGETS)
    assert all(is_adapter_key(key) for key in tensor_keys), tensor_keys
    moments = [key for key in saved.state_dict_metadata if key.startswith("optimizer.state.")]
    assert moments and all(is_adapter_key(key.rsplit(".", 1)[0]) for key in moments), moments
    weight_bytes = sum(
        saved.state_dict_metadata[key].size.numel() * 4
        for key in tensor_keys  # fp32
    )
    assert weight_bytes == sum(t.numel() * 4 for t in saved_adapter.values())
    # The files: adapters, two AdamW moments each, and DCP's per-tensor overhead (most of it
    # at this size); a full fine-tuning trainer/ is over 3x the model.
    trainer_bytes = sum(p.stat().st_size for p in (checkpoint / TRAINER_SUBDIR).iterdir())
    model_bytes = (tiny_model_dir / "model.safetensors").stat().st_size
    assert trainer_bytes < model_bytes / 3, (trainer_bytes, model_bytes)

    resumed = PyTorchActorModel(**trainer_kwargs(tiny_model_dir, config=config))
    resumed.setup(checkpoint_dir=str(checkpoint))
    assert resumed.steps_run == 2
    torch.testing.assert_close(resumed.adapter_state_dict(), saved_adapter, rtol=0, atol=0)
    for batch in batches[2:]:
        resumed.train_step(batch)
    assert_same_training_state(gathered_training_state(resumed), expected)
    assert resumed.lr_scheduler.last_epoch == straight.lr_scheduler.last_epoch == 4
    assert resumed.lr_scheduler.get_last_lr() == straight.lr_scheduler.get_last_lr()
