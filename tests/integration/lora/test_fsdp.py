"""LoRA training across FSDP workers: the loss, every adapter gradient and the adapters after
two steps are those of one worker (tiny Qwen2, CPU, gloo, two trainer actors in Ray)."""

from __future__ import annotations

import pytest
import torch

from grpo.workers.trainer import PyTorchActorModel
from tests.unit.lora.test_training import (
    SGD,
    make_batch,
    new_trainer,
    trainer_kwargs,
    training_config,
)

pytestmark = pytest.mark.slow


def test_two_fsdp_workers_match_one_worker(tiny_model_dir, ray_cluster):
    """Loss, every adapter gradient and the adapters after two SGD steps: the same on one
    worker and on two FSDP workers (gloo) sharing the batch, reference forwards included."""
    config = training_config(optimizer=SGD)
    # Both batches split into 1 pack on one worker and 2 on the other: the first runs a
    # filler forward and backward (and a filler reference forward) to match FSDP collectives.
    batches = [make_batch(12, seed=5), make_batch(16, seed=10)]

    def adapter_gradients(trainer) -> dict:
        # Under FSDP each rank holds a shard of each gradient: gathered, on every rank.
        grads = {}
        for name, param in trainer.policy.model.named_parameters():
            if not param.requires_grad:
                assert param.grad is None, f"frozen {name} has a gradient"
                continue
            grad = param.grad
            if hasattr(grad, "full_tensor"):
                grad = grad.full_tensor()
            grads[name] = grad.detach().cpu().clone()
        return grads

    single = new_trainer(tiny_model_dir, config=config)
    single_losses = []
    for batch in batches:
        metrics = single.train_step(batch)
        single_losses.append(metrics["training/loss"])
    assert metrics["training/num_micro_batches"] >= 2
    single_grads = adapter_gradients(single)
    single_adapter = single.adapter_state_dict()

    ray = ray_cluster
    remote_cls = ray.remote(num_cpus=1)(PyTorchActorModel)
    workers = [
        remote_cls.remote(**trainer_kwargs(tiny_model_dir, rank, 2, config=config))
        for rank in range(2)
    ]
    try:
        address = ray.get(workers[0].get_dist_address.remote())
        ray.get([w.setup.remote(address) for w in workers])
        losses = []
        for batch in batches:
            batch_ref = ray.put(batch)
            metrics = ray.get([w.train_step.remote(batch_ref) for w in workers])
            losses.append(metrics[0]["training/loss"])
            packs = sorted(m["training/num_micro_batches"] for m in metrics)
            assert packs == [1.0, 2.0]
        grads = ray.get([w.__ray_call__.remote(adapter_gradients) for w in workers])[0]
        adapter = ray.get([w.adapter_state_dict.remote() for w in workers])[0]
        ray.get([w.shutdown.remote() for w in workers])
    finally:
        for worker in workers:
            ray.kill(worker)

    assert losses == pytest.approx(single_losses, rel=1e-4)
    assert grads.keys() == single_grads.keys()
    for name, expected in single_grads.items():
        scale = float(expected.abs().max())
        assert scale > 0, f"{name} got no gradient"
        torch.testing.assert_close(grads[name], expected, rtol=1e-4, atol=1e-4 * scale)
    for name, expected in single_adapter.items():
        scale = float(expected.abs().max())
        torch.testing.assert_close(adapter[name], expected, rtol=1e-4, atol=1e-4 * scale)
