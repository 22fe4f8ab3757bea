"""The trainer across FSDP workers in Ray (the same update however many workers share the batch)
and compiled layers: the tests that start a Ray cluster or a vLLM engine.

The tests without either: tests/unit/test_trainer.py.
"""

from __future__ import annotations

import pytest

from grpo.testing import gathered_training_state
from grpo.types import ScoredTrajectory
from grpo.workers.trainer import PyTorchActorModel, TrainingConfig
from tests.helpers.training_state import assert_same_training_state
from tests.unit.test_trainer import (
    LOSS,
    assert_same_update,
    make_batch,
    trainer_kwargs,
)


def train_on_two_workers(ray, worker_kwargs: list[dict], batch: list[ScoredTrajectory]):
    """One `train_step` on two FSDP trainer actors; their metrics and full state dicts."""
    remote_cls = ray.remote(num_cpus=1)(PyTorchActorModel)
    workers = [remote_cls.remote(**kwargs) for kwargs in worker_kwargs]
    try:
        address = ray.get(workers[0].get_dist_address.remote())
        ray.get([w.setup.remote(address) for w in workers])
        batch_ref = ray.put(batch)
        metrics = ray.get([w.train_step.remote(batch_ref) for w in workers])
        weights = ray.get([w.full_state_dict.remote() for w in workers])
        ray.get([w.shutdown.remote() for w in workers])
    finally:
        for worker in workers:
            ray.kill(worker)
    return metrics, weights


@pytest.mark.slow
def test_two_fsdp_workers_match_one_worker(tiny_model_dir, ray_cluster):
    # Shared prompts: each worker trains on whole prompt groups (`grpo.packing.packs.shard_batch`).
    batch = make_batch(12, vocab_size=300, seed=1, shared_prompts=True)
    single = PyTorchActorModel(**trainer_kwargs(tiny_model_dir, 0, 1, 256))
    single.setup()
    before = single.full_state_dict()
    single_metrics = single.train_step(batch)
    single_weights = single.full_state_dict()

    metrics, weights = train_on_two_workers(
        ray_cluster, [trainer_kwargs(tiny_model_dir, r, 2, 256) for r in range(2)], batch
    )

    assert metrics[0]["training/loss"] == pytest.approx(single_metrics["training/loss"], rel=1e-4)
    assert_same_update(before, single_weights, weights[0])


@pytest.mark.slow
@pytest.mark.parametrize("mask_kind", ["dense", "varlen"])
def test_compiled_layers_give_the_eager_loss_and_gradients(tiny_model_dir, mask_kind):
    # About a minute per mask kind on 2 CPU cores, almost all of it inductor compiling.
    batch = make_batch(10, vocab_size=300)
    results = []
    for compile_layers in (False, True):
        kwargs = trainer_kwargs(tiny_model_dir, 0, 1, budget=128)
        kwargs["config"] = kwargs["config"].model_copy(
            update={"mask_kind": mask_kind, "compile": compile_layers}
        )
        trainer = PyTorchActorModel(**kwargs)
        trainer.setup()
        before = trainer.full_state_dict()
        metrics = trainer.train_step(batch)
        results.append((metrics, trainer.full_state_dict()))
        # A second batch packs to other lengths: dynamic shapes, no recompile per length.
        trainer.train_step(make_batch(10, vocab_size=300, seed=1))
    (eager, weights_eager), (compiled, weights_compiled) = results
    assert eager["training/num_micro_batches"] >= 2
    assert compiled["training/loss"] == pytest.approx(eager["training/loss"], rel=1e-5)
    assert compiled["training/grad_norm"] == pytest.approx(eager["training/grad_norm"], rel=1e-5)
    assert_same_update(before, weights_eager, weights_compiled, rtol=1e-5)


@pytest.mark.slow
def test_training_state_reshards_between_one_and_two_workers(tiny_model_dir, ray_cluster, tmp_path):
    """A checkpoint saved by one worker resumes on two FSDP workers and the other way round:
    weights, AdamW moments and step counts come back bit for bit in the new sharding."""
    config = TrainingConfig(
        optimizer={"_component_": "torch.optim.AdamW", "lr": 1e-3},
        lr_scheduler={
            "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
            "num_warmup_steps": 1,
        },
        loss=LOSS,
    )

    def kwargs(rank, world_size):
        return {**trainer_kwargs(tiny_model_dir, rank, world_size, 256), "config": config}

    single = PyTorchActorModel(**kwargs(0, 1))
    single.setup()
    single.train_step(make_batch(8, vocab_size=300))
    saved_by_one = tmp_path / "saved_by_one"
    saved_by_one.mkdir()
    single.save_checkpoint(str(saved_by_one))
    expected = gathered_training_state(single)

    ray = ray_cluster
    remote_cls = ray.remote(num_cpus=1)(PyTorchActorModel)
    workers = [remote_cls.remote(**kwargs(r, 2)) for r in range(2)]
    saved_by_two = tmp_path / "saved_by_two"
    saved_by_two.mkdir()
    try:
        address = ray.get(workers[0].get_dist_address.remote())
        ray.get([w.setup.remote(address, str(saved_by_one)) for w in workers])
        states = ray.get([w.__ray_call__.remote(gathered_training_state) for w in workers])
        assert_same_training_state(states[0], expected)
        # Train on, save in the two-worker sharding, and load that into one worker.
        batch_ref = ray.put(make_batch(8, vocab_size=300, seed=1))
        ray.get([w.train_step.remote(batch_ref) for w in workers])
        ray.get([w.save_checkpoint.remote(str(saved_by_two)) for w in workers])
        expected = ray.get([w.__ray_call__.remote(gathered_training_state) for w in workers])[0]
        ray.get([w.shutdown.remote() for w in workers])
    finally:
        for worker in workers:
            ray.kill(worker)
    assert sorted(p.name for p in (saved_by_two / "trainer").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    resumed = PyTorchActorModel(**kwargs(0, 1))
    resumed.setup(checkpoint_dir=str(saved_by_two))
    assert expected["steps_run"] == 2
    assert_same_training_state(gathered_training_state(resumed), expected)


@pytest.mark.slow
def test_two_fsdp_workers_match_one_worker_with_tis_over_two_epochs(tiny_model_dir, ray_cluster):
    # The no-grad forward for pi_old runs under FSDP (at this budget rank 1 plans one pack
    # fewer, so it runs a filler forward) and the mismatch max is reduced with MAX over ranks.
    batch = make_batch(12, vocab_size=300, seed=2)
    loss = {**LOSS, "tis_cap": 2.0}

    def kwargs(rank, world_size):
        result = trainer_kwargs(tiny_model_dir, rank, world_size, 128, loss=loss)
        result["config"] = result["config"].model_copy(update={"ppo_epochs": 2})
        return result

    single = PyTorchActorModel(**kwargs(0, 1))
    single.setup()
    before = single.full_state_dict()
    single_metrics = single.train_step(batch)
    single_weights = single.full_state_dict()

    metrics, weights = train_on_two_workers(ray_cluster, [kwargs(r, 2) for r in range(2)], batch)

    for name in ("loss", "mismatch_kl", "mismatch_max_abs"):
        key = f"training/{name}"
        assert metrics[0][key] == pytest.approx(single_metrics[key], rel=1e-4), key
        assert metrics[1][key] == metrics[0][key], key
    assert_same_update(before, single_weights, weights[0])
