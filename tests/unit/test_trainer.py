"""The trainer's update does not depend on how many workers share the batch.

The tests that start a Ray cluster or a vLLM engine: tests/integration/test_trainer.py.
"""

import math

import pytest
import torch

from grpo.objective.loss import GRPOLoss
from grpo.observability.metric_names import (
    TRAIN_CORRECTION_MASKED_FRACTION,
    TRAIN_CORRECTION_MASKED_SEQUENCE_FRACTION,
)
from grpo.testing import gathered_training_state
from grpo.types import ScoredTrajectory
from grpo.workers.trainer import PyTorchActorModel, TrainingConfig
from tests.helpers.training_state import assert_same_training_state

LOSS = {
    "_component_": "grpo.objective.loss.GRPOLoss",
    "epsilon_low": 0.2,
    "epsilon_high": 0.2,
    "kl_coeff": 0.05,
    "kl_estimator": "k3",
    "aggregation": "token_mean",
}
# Plain SGD: the weight change is exactly -lr * gradient, so comparing weights compares gradients.
OPTIMIZER = {"_component_": "torch.optim.SGD", "lr": 0.5}


def make_batch(
    num_sequences: int, vocab_size: int, seed: int = 0, shared_prompts: bool = False
) -> list[ScoredTrajectory]:
    """Groups of 4 (``group_id = i // 4``); each sequence has its own random prompt unless
    ``shared_prompts``, where the members of a group answer one prompt, as in GRPO."""
    generator = torch.Generator().manual_seed(seed)
    batch = []
    for i in range(num_sequences):
        prompt_len = int(torch.randint(3, 20, (1,), generator=generator))
        response_len = int(torch.randint(1, 24, (1,), generator=generator))
        prompt = torch.randint(0, vocab_size, (prompt_len,), generator=generator)
        if shared_prompts and i % 4:
            prompt = batch[-1].prompt_tokens
            prompt_len = prompt.numel()
        batch.append(
            ScoredTrajectory(
                prompt_tokens=prompt,
                response_tokens=torch.randint(0, vocab_size, (response_len,), generator=generator),
                prompt_len=prompt_len,
                response_len=response_len,
                logprobs=-torch.rand(response_len, generator=generator) * 6,
                ref_logprobs=-torch.rand(response_len, generator=generator) * 6,
                rewards=torch.tensor([float(i % 2)]),
                advantages=torch.randn((), generator=generator),
                successes=torch.tensor([float(i % 2)]),
                answer="1",
                sequence_id=f"s{i}",
                group_id=i // 4,
                reward_metadata={"func_names": ["toy"]},
                policy_version=0,
            )
        )
    return batch


def assert_same_update(before, after_expected, after_actual, rtol=1e-4):
    """Weight changes (lr * gradient for SGD) agree to fp32 accumulation-order noise."""
    changed = 0
    for name, start in before.items():
        expected = after_expected[name] - start
        actual = after_actual[name] - start
        scale = float(expected.abs().max())
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale + 1e-9)
        changed += int(scale > 0)
    assert changed > len(before) // 2, "the step changed almost no weights"


def trainer_kwargs(model_dir, rank, world_size, budget, loss=LOSS, share_prompts=True):
    return dict(
        rank=rank,
        world_size=world_size,
        model_dir=str(model_dir),
        num_steps=1,
        target_tokens_per_batch=budget,
        pad_token_id=0,
        share_prompts=share_prompts,
        config=TrainingConfig(
            optimizer=OPTIMIZER, lr_scheduler=None, loss=loss, clip_grad_norm=None
        ),
    )


def test_micro_batch_split_does_not_change_the_update(tiny_model_dir):
    batch = make_batch(10, vocab_size=300)
    results = []
    for budget in (1024, 48):  # one pack vs. many packs with gradient accumulation
        trainer = PyTorchActorModel(**trainer_kwargs(tiny_model_dir, 0, 1, budget))
        trainer.setup()
        before = trainer.full_state_dict()
        metrics = trainer.train_step(batch)
        results.append((metrics, trainer.full_state_dict()))
    (one_pack, weights_one), (many_packs, weights_many) = results
    assert one_pack["training/num_micro_batches"] == 1
    assert many_packs["training/num_micro_batches"] >= 3
    assert many_packs["training/loss"] == pytest.approx(one_pack["training/loss"], rel=1e-5)
    assert_same_update(before, weights_one, weights_many)


def test_shared_prompts_give_the_unshared_loss_and_update(tiny_model_dir):
    """Same batch (groups answering one prompt), one worker: sharing prompts changes the
    tokens computed, not the loss or the update; many packs (budget 48) and one (1024)."""
    batch = make_batch(12, vocab_size=300, shared_prompts=True)
    for budget in (1024, 48):
        results = []
        for share_prompts in (False, True):
            trainer = PyTorchActorModel(
                **trainer_kwargs(tiny_model_dir, 0, 1, budget, share_prompts=share_prompts)
            )
            trainer.setup()
            before = trainer.full_state_dict()
            metrics = trainer.train_step(batch)
            results.append((metrics, trainer.full_state_dict()))
        (plain, weights_plain), (shared, weights_shared) = results
        assert plain["training_perf/shared_prompt_tokens_saved (%)"] == 0.0
        saved = shared["training_perf/shared_prompt_tokens_saved (%)"]
        assert 10.0 < saved < 100.0, saved
        for name in ("loss", "policy_loss", "kl_loss", "ratios", "clipfrac"):
            key = f"training/{name}"
            assert shared[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key
        assert_same_update(before, weights_plain, weights_shared, rtol=1e-5)


def test_non_finite_steps_are_skipped_counted_and_leave_the_weights(tiny_model_dir):
    batch = make_batch(6, vocab_size=300)
    trainer = PyTorchActorModel(
        **trainer_kwargs(
            tiny_model_dir, 0, 1, 1024, loss={**LOSS, "_component_": "grpo.testing.NonFiniteLoss"}
        )
    )
    trainer.setup()
    before = trainer.full_state_dict()
    for expected_in_a_row in (1, 2):
        metrics = trainer.train_step(batch)
        assert metrics["training/nonfinite_steps_skipped"] == expected_in_a_row
        assert metrics["training/nonfinite_steps_in_a_row"] == expected_in_a_row
    for name, tensor in trainer.full_state_dict().items():
        assert torch.equal(tensor, before[name]), f"{name} changed in a skipped step"

    # A finite step ends the streak and updates the weights; the skip count stays.
    trainer.loss_fn = GRPOLoss(**{k: v for k, v in LOSS.items() if k != "_component_"})
    metrics = trainer.train_step(batch)
    assert metrics["training/nonfinite_steps_in_a_row"] == 0
    assert metrics["training/nonfinite_steps_skipped"] == 2
    after = trainer.full_state_dict()
    assert any(not torch.equal(after[name], before[name]) for name in before)


def test_a_policy_version_counts_training_steps(tiny_model_dir):
    """Weights published after N steps are version N however many steps passed between two
    syncs (weight_sync.every_n_steps), so staleness (orchestration.max_policy_lag, the policy
    age) is counted in steps."""
    batch = make_batch(4, vocab_size=300)
    trainer = PyTorchActorModel(**trainer_kwargs(tiny_model_dir, 0, 1, 1024))
    trainer.setup()
    assert {t.policy_version for t in batch} == {0}
    ages = [trainer.train_step(batch)["training/policy_age_max"] for _ in range(2)]
    assert ages == [0.0, 1.0]  # the base model's samples, trained by weights 0 then 1 step old
    assert trainer.publish_weights("object_store")["version"] == trainer.policy_version == 2
    trainer.train_step(batch)
    assert trainer.publish_weights("object_store")["version"] == 3


class _Counter:
    """A minimal `Stateful` for the checkpointer's run state and pipeline."""

    def __init__(self, key: str) -> None:
        self.key, self.value = key, 0

    def state_dict(self) -> dict:
        return {self.key: self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state[self.key]


def test_a_crash_mid_save_leaves_the_previous_checkpoint_resumable(tiny_model_dir, tmp_path):
    """The trainer writes its shards into the checkpointer's temporary folder: a save that
    dies after them leaves ``latest`` on the previous checkpoint, which still resumes."""
    from grpo.orchestrator.checkpointer import Checkpointer, find_checkpoint
    from grpo.workers.training_checkpoint import load_training_state

    config = TrainingConfig(optimizer={"_component_": "torch.optim.AdamW", "lr": 1e-3}, loss=LOSS)
    kwargs = {**trainer_kwargs(tiny_model_dir, 0, 1, 256), "config": config}
    trainer = PyTorchActorModel(**kwargs)
    trainer.setup()
    trainer.train_step(make_batch(6, vocab_size=300))
    expected = gathered_training_state(trainer)

    def save_then_crash(folder):
        trainer.save_checkpoint(str(folder))
        raise RuntimeError("killed mid-save")

    saves = [lambda folder: trainer.save_checkpoint(str(folder)), save_then_crash]
    checkpointer = Checkpointer(
        tmp_path, _Counter("step"), [_Counter("pipeline")], lambda folder: saves.pop(0)(folder)
    )
    first = checkpointer.save(1)
    assert sorted(p.name for p in (first / "trainer").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "extra.pt",
    ]
    trainer.train_step(make_batch(6, vocab_size=300, seed=1))
    with pytest.raises(RuntimeError, match="killed mid-save"):
        checkpointer.save(2)

    assert find_checkpoint(tmp_path, True) == first
    resumed = PyTorchActorModel(**kwargs)
    resumed.setup(checkpoint_dir=str(first))
    assert_same_training_state(gathered_training_state(resumed), expected)
    with pytest.raises(FileNotFoundError, match="missing .metadata, extra.pt"):
        load_training_state(resumed.policy, resumed.optimizer, tmp_path / "nothing_here")


def test_a_resumed_trainer_runs_the_configured_lr_and_its_schedule_goes_on(
    tiny_model_dir, tmp_path
):
    """A checkpoint of step 2 of a 3-step cosine schedule, resumed (1) for a 6-step run: the
    lr goes on decaying from where it was instead of jumping up to the longer schedule's;
    (2) with another lr and weight decay: both run, the schedule scaled by the new lr;
    (3) unchanged: the schedule is exactly as saved."""
    schedule = {
        "_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
        "num_warmup_steps": 1,
        "num_cycles": 0.25,
    }

    def trainer(num_steps: int, lr: float, weight_decay: float = 0.0) -> PyTorchActorModel:
        optimizer = {"_component_": "torch.optim.AdamW", "lr": lr, "weight_decay": weight_decay}
        config = TrainingConfig(optimizer=optimizer, lr_scheduler=schedule, loss=LOSS)
        kwargs = trainer_kwargs(tiny_model_dir, 0, 1, 256)
        return PyTorchActorModel(**{**kwargs, "num_steps": num_steps, "config": config})

    def factor(step: int, num_steps: int) -> float:  # the schedule: 1 warm-up step, cosine
        if step < 1:
            return float(step)
        return 0.5 * (1 + math.cos(math.pi * 0.5 * (step - 1) / (num_steps - 1)))

    def logged_lrs(model: PyTorchActorModel, steps: int) -> list[float]:
        # The lr metric is read after the schedule's step: the lr of the next update.
        batch = make_batch(6, vocab_size=300)
        return [model.train_step(batch)["training/lr"] for _ in range(steps)]

    checkpoint = tmp_path / "step_2"
    first = trainer(num_steps=3, lr=3e-4)
    first.setup()
    lrs = logged_lrs(first, 2)
    first.save_checkpoint(str(checkpoint))
    assert lrs == pytest.approx([3e-4 * factor(1, 3), 3e-4 * factor(2, 3)], rel=1e-12)

    longer = trainer(num_steps=6, lr=3e-4)
    longer.setup(checkpoint_dir=str(checkpoint))
    assert longer.optimizer.param_groups[0]["lr"] == lrs[-1]
    after = logged_lrs(longer, 2)
    base = lrs[-1] / factor(2, 6)
    assert after == pytest.approx([base * factor(3, 6), base * factor(4, 6)], rel=1e-12)
    assert lrs[-1] > after[0] > after[1]
    assert 3e-4 * factor(3, 6) > lrs[-1]  # where the rebuilt schedule alone would have jumped

    changed = trainer(num_steps=3, lr=1e-4, weight_decay=0.1)
    changed.setup(checkpoint_dir=str(checkpoint))
    assert changed.optimizer.param_groups[0]["weight_decay"] == 0.1
    assert logged_lrs(changed, 1) == pytest.approx([1e-4 * factor(3, 3)], rel=1e-12)

    same = trainer(num_steps=3, lr=3e-4)
    same.setup(checkpoint_dir=str(checkpoint))
    saved = first.lr_scheduler.state_dict()
    restored = same.lr_scheduler.state_dict()
    assert (restored["base_lrs"], restored["_last_lr"]) == (saved["base_lrs"], saved["_last_lr"])


class RecordingLoss(GRPOLoss):
    """The loss, keeping what each call received: pi, pi_old and the behaviour logprobs."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls: list[dict[str, torch.Tensor | None]] = []

    def compute_loss_from_logprobs(self, pi_logprobs, ref_logprobs, advantages, behavior, **kw):
        old = kw.get("old_logprobs")
        self.calls.append(
            {
                "pi": pi_logprobs.detach().clone(),
                "old": None if old is None else old.detach().clone(),
                "behaviour": behavior.detach().clone(),
                "lens": kw["response_lens"].clone(),
            }
        )
        return super().compute_loss_from_logprobs(
            pi_logprobs, ref_logprobs, advantages, behavior, **kw
        )


def _expected_mismatch(calls):
    """Token mean of k3(exp(pi_old - mu)) and max |pi_old - mu| over the recorded calls."""
    gaps = torch.cat([(c["pi"] if c["old"] is None else c["old"]) - c["behaviour"] for c in calls])
    k3 = torch.exp(gaps) - 1 - gaps
    return float(k3.double().mean()), float(gaps.abs().max())


@pytest.mark.parametrize("ppo_epochs", [1, 2])
def test_train_step_reports_the_mismatch_of_pi_old_and_behaviour(tiny_model_dir, ppo_epochs):
    batch = make_batch(8, vocab_size=300)
    kwargs = trainer_kwargs(tiny_model_dir, 0, 1, budget=64)
    kwargs["config"] = kwargs["config"].model_copy(update={"ppo_epochs": ppo_epochs})
    trainer = PyTorchActorModel(**kwargs)
    trainer.setup()
    loss_options = {k: v for k, v in LOSS.items() if k != "_component_"}
    trainer.loss_fn = RecordingLoss(**loss_options, tis_cap=2.0)
    metrics = trainer.train_step(batch)

    num_packs = int(metrics["training/num_micro_batches"])
    assert num_packs >= 2
    calls = trainer.loss_fn.calls
    assert len(calls) == ppo_epochs * num_packs
    if ppo_epochs == 1:
        # pi_old is the first forward's pi: no extra forward, nothing passed.
        assert all(call["old"] is None for call in calls)
    else:
        first, second = calls[:num_packs], calls[num_packs:]
        for before, after in zip(first, second):
            # The no-grad forward ran on the pre-update weights: it equals the first epoch's
            # pi, and the second epoch (after an update) still gets that same pi_old.
            torch.testing.assert_close(before["old"], before["pi"], rtol=0, atol=1e-6)
            assert torch.equal(after["old"], before["old"])
            assert not torch.allclose(after["pi"], after["old"], atol=1e-4)
    # Every epoch sees the same pi_old, so the metrics are those of one epoch's calls.
    expected_kl, expected_max = _expected_mismatch(calls[:num_packs])
    assert _expected_mismatch(calls) == pytest.approx((expected_kl, expected_max))
    assert metrics["training/mismatch_kl"] == pytest.approx(expected_kl, rel=1e-5)
    assert metrics["training/mismatch_max_abs"] == pytest.approx(expected_max, rel=1e-6)
    assert expected_kl > 0.1  # make_batch's behaviour logprobs are far from the model's


def test_train_step_reports_the_fraction_the_correction_masked(tiny_model_dir):
    batch = make_batch(8, vocab_size=300)
    trainer = PyTorchActorModel(**trainer_kwargs(tiny_model_dir, 0, 1, budget=64))
    trainer.setup()
    loss_options = {k: v for k, v in LOSS.items() if k != "_component_"}
    # make_batch's behaviour logprobs are far above the tiny model's (sequence log-ratios from
    # about -6 to -57): a lower bound of e^-20.7 masks some sequences whole and keeps others.
    trainer.loss_fn = RecordingLoss(
        **loss_options, correction="mis", correction_level="sequence", correction_low=1e-9
    )
    metrics = trainer.train_step(batch)

    # One epoch: pi_old is each call's pi. A sequence is masked where the product of its
    # tokens' exp(pi_old - mu) leaves [1e-9, 2], and all its tokens with it.
    calls = trainer.loss_fn.calls
    sums = torch.cat(
        [
            torch.stack(
                [gap.sum() for gap in torch.split(c["pi"] - c["behaviour"], c["lens"].tolist())]
            )
            for c in calls
        ]
    )
    lens = torch.cat([c["lens"] for c in calls])
    masked = (sums < math.log(1e-9)) | (sums > math.log(2.0))
    assert 0 < int(masked.sum()) < len(batch) == len(lens)
    assert metrics[TRAIN_CORRECTION_MASKED_SEQUENCE_FRACTION] == pytest.approx(
        int(masked.sum()) / len(batch)
    )
    assert metrics[TRAIN_CORRECTION_MASKED_FRACTION] == pytest.approx(
        int(lens[masked].sum()) / int(lens.sum())
    )
