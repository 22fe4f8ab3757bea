"""Weight sync into vLLM engines and collector actors: the tests that start a Ray cluster or a vLLM
engine.

The tests without either: tests/unit/test_weight_sync.py.
"""

from __future__ import annotations

import contextlib
import queue
import time

import pytest
import torch

from grpo.rewards import MathCorrectnessReward
from grpo.weights.checksum import WeightSyncError, state_dict_checksum
from tests.unit.test_weight_sync import (
    ENGINE_ARGS,
    GROUP_SIZE,
    MAX_GENERATED_TOKENS,
    SWITCH_STEP,
)


def long_prompt_dataset():
    """Two prompts of ~300 tokens, read again by every batch.

    vLLM's CPU KV blocks hold 128 tokens and only full blocks are cached, so these prompts
    hit the prefix cache: a stale cache after a weight update would show in the logprobs.
    """
    from grpo.data import AnswerOnlyTemplate, PromptDataset

    question = " ".join(f"What is {a} + {a + 3}?" for a in range(40))
    examples = [
        {"question": question, "answer": "1"},
        {"question": question + " Go", "answer": "2"},
    ]
    return PromptDataset(examples, AnswerOnlyTemplate())


def make_collector(model_dir):
    from grpo.workers.collector import InferenceConfig, SyncLLMCollector

    config = InferenceConfig(
        engine_args=ENGINE_ARGS,
        group_size=GROUP_SIZE,
        max_generated_tokens=MAX_GENERATED_TOKENS,
        max_prompt_tokens=512,
    )
    return SyncLLMCollector(
        0,
        1,
        model_dir,
        long_prompt_dataset(),
        queue.Queue(),
        config,
        seed=0,
        reward_functions=[MathCorrectnessReward()],
    )


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tiny_untied_model_dir):
    """(model_dir, collector) for a tied-embedding and an untied tiny Qwen2.

    Both engines live for the whole module and are closed together (in-process vLLM engines
    share global state; see SyncLLMCollector.shutdown).
    """
    tied_dir, untied_dir = tiny_model_dir, tiny_untied_model_dir
    tied, untied = make_collector(tied_dir), make_collector(untied_dir)
    yield {"tied": (tied_dir, tied), "untied": (untied_dir, untied)}
    untied.shutdown()
    tied.shutdown()


def trainer_side(model_dir):
    """What the trainer holds: a torchtune model and the HF config to rename its weights."""
    from grpo.models import build_model, load_hf_config

    return build_model(model_dir, dtype=torch.float32).eval(), load_hf_config(model_dir)


def perturb(model, seed: int, scale: float = 0.05) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))


def hf_weights(model, hf_config):
    from grpo.models import tune_to_hf_state_dict

    return {k: v.clone() for k, v in tune_to_hf_state_dict(model.state_dict(), hf_config).items()}


def forward_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    """Logprob of tokens[1:] under a torchtune model (fp32)."""
    with torch.no_grad():
        logits = model(tokens[None])[0].float()
    return torch.log_softmax(logits[:-1], dim=-1).gather(-1, tokens[1:, None])[:, 0]


def generated_trajectories(collector, num_prompts=2):
    collector.generate_batch(num_prompts)
    return [
        t for _ in range(num_prompts) for t in collector.rollout_queue.get(timeout=30).trajectories
    ]


def max_logprob_error(model, trajectories) -> float:
    error = 0.0
    for t in trajectories:
        tokens = torch.cat([t.prompt_tokens, t.response_tokens])
        expected = forward_logprobs(model, tokens)[t.prompt_len - 1 :]
        error = max(error, float((expected - t.logprobs).abs().max()))
    return error


@pytest.mark.slow
def test_initial_checksum_is_the_trainers_checksum(engines):
    for model_dir, collector in engines.values():
        model, hf_config = trainer_side(model_dir)
        assert collector.get_weights_checksum() == state_dict_checksum(hf_weights(model, hf_config))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_update_is_applied_between_batches_and_used(engines, kind):
    model_dir, collector = engines[kind]
    model, hf_config = trainer_side(model_dir)
    # Start from the checkpoint's weights whatever ran before.
    base = hf_weights(model, hf_config)
    assert collector.receive_weights(base, collector.policy_version + 1, state_dict_checksum(base))
    before = generated_trajectories(collector)  # also fills the prefix cache with the prompts
    assert max_logprob_error(model, before) < 1e-3
    version = collector.policy_version

    old_model, _ = trainer_side(model_dir)
    old_model.load_state_dict(model.state_dict())
    perturb(model, seed=version + 1)
    weights = hf_weights(model, hf_config)
    checksum = state_dict_checksum(weights)
    assert collector.receive_weights(weights, version + 1, checksum)
    assert collector.policy_version == version  # pending until the next batch

    after = generated_trajectories(collector)
    assert collector.policy_version == version + 1
    assert all(t.policy_version == version + 1 for t in after)
    assert collector.get_weights_checksum() == checksum
    # The engine samples with the new weights (prompt KV recomputed, output head rebuilt)...
    assert max_logprob_error(model, after) < 1e-3
    # ...which is visible: the old weights explain the new samples badly.
    assert max_logprob_error(old_model, after) > 0.05
    probe = torch.cat([after[0].prompt_tokens, after[0].response_tokens])
    torch.testing.assert_close(
        torch.tensor(collector.probe_logprobs(probe.tolist())),
        forward_logprobs(model, probe),
        atol=1e-3,
        rtol=0,
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_cpu_engines_reload_their_packed_layers_in_place(engines, kind, monkeypatch):
    """A CPU engine's update fills its packed linear layers itself, not through vLLM's generic
    layerwise reload; a state dict that leaves a packed layer unfilled goes to vLLM's."""
    from grpo.weights import engine as engine_module

    model_dir, collector = engines[kind]
    _, new_model, weights = base_and_new_weights(collector, model_dir, seed=14)
    real_reload, outcomes = engine_module.reload_cpu_linear_weights, []

    def recorded_reload(runner, state_dict):
        outcomes.append(real_reload(runner, state_dict))
        return outcomes[-1]

    monkeypatch.setattr(engine_module, "reload_cpu_linear_weights", recorded_reload)
    checksum = state_dict_checksum(weights)
    assert collector.receive_weights(weights, collector.policy_version + 1, checksum)
    collector.apply_pending_weights()
    assert outcomes == [True]
    probe = probe_of(new_model)

    def assert_engine_computes_new_model():
        torch.testing.assert_close(
            torch.tensor(collector.probe_logprobs(probe["token_ids"])),
            torch.tensor(probe["logprobs"]),
            atol=1e-3,
            rtol=0,
        )

    assert_engine_computes_new_model()
    unfilled = {k: v for k, v in weights.items() if not k.endswith("layers.0.mlp.down_proj.weight")}
    assert collector.llm.collective_rpc(
        lambda worker: real_reload(worker.model_runner, unfilled)
    ) == [False]
    collector.llm.reset_prefix_cache()
    assert_engine_computes_new_model()  # its packed layers as they were
    # Packed weights larger than the cap: vLLM's path, one layer at a time.
    monkeypatch.setattr(engine_module, "FAST_RELOAD_MAX_BYTES", 1024)
    assert collector.llm.collective_rpc(
        lambda worker: real_reload(worker.model_runner, weights)
    ) == [False]


@contextlib.contextmanager
def weight_updates(collector, mode: str):
    """The collector loads weights ``mode`` (in_flight, between_batches) inside the block."""
    previous, collector.engine.weight_updates = collector.engine.weight_updates, mode
    try:
        yield
    finally:
        collector.engine.weight_updates = previous


def offer_during_step(collector, step: int, offer) -> list[int]:
    """Call ``offer()`` inside the engine's ``step``-th scheduler step of the next batch.

    The update is then pending when that step returns and loaded before the next one: every
    sample has exactly ``step`` tokens from the old weights. Returns the list of the calls'
    numbers (to check the batch took more steps than that).
    """
    engine = collector.llm.llm_engine
    real_step, calls = engine.step, []

    def step_and_offer():
        outputs = real_step()
        calls.append(len(calls) + 1)
        if len(calls) == step:
            offer()
        return outputs

    engine.step = step_and_offer
    return calls


def sequence_logprobs(model, trajectory) -> torch.Tensor:
    """``model``'s logprob of each response token of ``trajectory``."""
    tokens = torch.cat([trajectory.prompt_tokens, trajectory.response_tokens])
    return forward_logprobs(model, tokens)[trajectory.prompt_len - 1 :]


def probe_of(model, seed: int = 0) -> dict:
    tokens = torch.arange(3 + seed, 40 + seed)
    return {"token_ids": tokens.tolist(), "logprobs": forward_logprobs(model, tokens).tolist()}


def base_and_new_weights(collector, model_dir, seed: int):
    """Put the checkpoint's weights in the engine (as a new version); return the torchtune
    model of those, a perturbed one, and the perturbed one's HF weights."""
    old_model, hf_config = trainer_side(model_dir)
    base = hf_weights(old_model, hf_config)
    assert collector.receive_weights(base, collector.policy_version + 1, state_dict_checksum(base))
    collector.apply_pending_weights()
    new_model, _ = trainer_side(model_dir)
    perturb(new_model, seed=seed)
    return old_model, new_model, hf_weights(new_model, hf_config)


def generate_with_update_at(collector, offer) -> tuple[list, dict]:
    """One 2-prompt batch with ``offer()`` called during its `SWITCH_STEP`-th step."""
    calls = offer_during_step(collector, SWITCH_STEP, offer)
    try:
        metrics = collector.generate_batch(2)
    finally:
        del collector.llm.llm_engine.step  # the instance attribute hid the engine's method
    assert len(calls) > SWITCH_STEP
    trajectories = [
        t for _ in range(2) for t in collector.rollout_queue.get(timeout=30).trajectories
    ]
    assert len(trajectories) == 2 * GROUP_SIZE  # nothing lost at the switch
    return trajectories, metrics


@pytest.mark.slow
def test_in_flight_update_switches_the_running_samples(engines):
    """New weights arrive while a batch samples: each sample's tokens before the switch are the
    old policy's, the ones after it the new policy's (its KV prefilled again), and the
    trajectory carries both versions."""
    model_dir, collector = engines["tied"]
    old_model, new_model, weights = base_and_new_weights(collector, model_dir, seed=11)
    version, checksum = collector.policy_version, state_dict_checksum(weights)
    trajectories, metrics = generate_with_update_at(
        collector,
        lambda: collector.receive_weights(weights, version + 1, checksum, probe_of(new_model)),
    )
    assert collector.policy_version == version + 1
    assert collector.get_weights_checksum() == checksum
    spanning = [t for t in trajectories if t.response_len > SWITCH_STEP]
    assert spanning, "every sample ended before the switch"
    for t in spanning:
        assert (t.policy_version, t.last_policy_version) == (version, version + 1)
        old, new = sequence_logprobs(old_model, t), sequence_logprobs(new_model, t)
        before, after = slice(0, SWITCH_STEP), slice(SWITCH_STEP, None)
        torch.testing.assert_close(t.logprobs[before], old[before], atol=1e-3, rtol=0)
        torch.testing.assert_close(t.logprobs[after], new[after], atol=1e-3, rtol=0)
        assert float((t.logprobs[after] - old[after]).abs().max()) > 0.05
    assert metrics["inference/weight_updates_in_flight"] == 1
    assert metrics["inference/time_engine_paused (s)"] > 0
    assert metrics["inference/trajectories_spanning_versions"] == len(spanning)
    assert metrics["inference/tokens_version_lag_1"] == SWITCH_STEP * len(spanning)
    assert metrics["inference/tokens_version_lag_0"] == (
        sum(t.response_len for t in trajectories) - SWITCH_STEP * len(spanning)
    )


@pytest.mark.slow
def test_in_flight_update_keeping_the_kv_cache(engines):
    """in_flight_keep_kv: the running samples go on with the new weights over the old
    weights' keys and values; once the batch is over no prompt reuses those cached blocks."""
    model_dir, collector = engines["tied"]
    old_model, new_model, weights = base_and_new_weights(collector, model_dir, seed=13)
    version, checksum = collector.policy_version, state_dict_checksum(weights)
    with weight_updates(collector, "in_flight_keep_kv"):
        trajectories, metrics = generate_with_update_at(
            collector, lambda: collector.receive_weights(weights, version + 1, checksum)
        )
        spanning = [t for t in trajectories if t.response_len > SWITCH_STEP]
        assert spanning and metrics["inference/weight_updates_in_flight"] == 1
        for t in spanning:
            assert (t.policy_version, t.last_policy_version) == (version, version + 1)
            old = sequence_logprobs(old_model, t)
            torch.testing.assert_close(
                t.logprobs[:SWITCH_STEP], old[:SWITCH_STEP], atol=1e-3, rtol=0
            )
            assert float((t.logprobs[SWITCH_STEP:] - old[SWITCH_STEP:]).abs().max()) > 0.05
        # The same prompts again (their blocks were cached by the old weights): exact.
        after = generated_trajectories(collector)
    assert {t.policy_version for t in after} == {version + 1}
    assert max_logprob_error(new_model, after) < 1e-3


@pytest.mark.slow
def test_in_flight_update_that_fails_verification_is_rolled_back(engines):
    """A checksum that does not match: the engine reloads its weights before sampling on. A
    probe that does not match: the samples running while it ran got a token from the rejected
    weights, so they are sampled again from their start: every token of every trajectory
    comes from the kept weights. Three rejections in a row stop the collector."""
    model_dir, collector = engines["tied"]
    old_model, new_model, weights = base_and_new_weights(collector, model_dir, seed=12)
    version, checksum = collector.policy_version, state_dict_checksum(weights)
    base_checksum = collector.get_weights_checksum()
    rejected_before = collector.totals["weight_updates_rejected"]

    trajectories, metrics = generate_with_update_at(
        collector, lambda: collector.receive_weights(weights, version + 1, "0" * 64)
    )
    assert collector.policy_version == version
    assert collector.get_weights_checksum() == base_checksum
    for t in trajectories:
        assert (t.policy_version, t.last_policy_version) == (version, version)
        torch.testing.assert_close(t.logprobs, sequence_logprobs(old_model, t), atol=1e-3, rtol=0)
    assert metrics["inference/weight_updates_rejected"] == rejected_before + 1

    wrong_probe = {**probe_of(new_model), "logprobs": [0.0] * 36}
    trajectories, _ = generate_with_update_at(
        collector, lambda: collector.receive_weights(weights, version + 1, checksum, wrong_probe)
    )
    assert collector.policy_version == version
    probe_token = SWITCH_STEP  # sampled in the step that also ran the probe
    assert any(t.response_len > probe_token + 1 for t in trajectories)
    for t in trajectories:
        assert (t.policy_version, t.last_policy_version) == (version, version)
        torch.testing.assert_close(t.logprobs, sequence_logprobs(old_model, t), atol=1e-3, rtol=0)

    # The third rejection in a row ends the batch, and leaves no request in the engine.
    offer_during_step(
        collector, SWITCH_STEP, lambda: collector.receive_weights(weights, version + 1, "0" * 64)
    )
    try:
        with pytest.raises(WeightSyncError, match="3 weight updates in a row"):
            collector.generate_batch(2)
    finally:
        del collector.llm.llm_engine.step
    assert collector.policy_version == version
    assert not collector.llm.llm_engine.has_unfinished_requests()
    assert collector.rollout_queue.empty()
    # A good update ends the run of rejections; the next batch samples with it.
    assert collector.receive_weights(weights, version + 1, checksum)
    trajectories = generated_trajectories(collector)
    assert {(t.policy_version, t.last_policy_version) for t in trajectories} == {
        (version + 1, version + 1)
    }
    assert max_logprob_error(new_model, trajectories) < 1e-3


@pytest.mark.slow
def test_object_store_ref_and_probe_are_checked(engines, ray_cluster):
    model_dir, collector = engines["tied"]
    model, hf_config = trainer_side(model_dir)
    perturb(model, seed=100)
    weights = hf_weights(model, hf_config)
    probe_tokens = torch.arange(3, 40)
    probe = {
        "token_ids": probe_tokens.tolist(),
        "logprobs": forward_logprobs(model, probe_tokens).tolist(),
        "atol": 1e-3,
    }
    version = collector.policy_version + 1
    ref = ray_cluster.put(weights)
    assert collector.receive_weights(ref, version, state_dict_checksum(weights), probe)
    seconds = collector.apply_pending_weights()
    assert seconds > 0
    assert collector.policy_version == version
    assert collector.get_weights_checksum() == state_dict_checksum(weights)
    assert collector.apply_pending_weights() == 0.0  # nothing pending any more

    # A probe the engine cannot reproduce means the engine does not use the sent weights.
    wrong = {**probe, "logprobs": [x + 0.5 for x in probe["logprobs"]]}
    assert collector.receive_weights(weights, version + 1, state_dict_checksum(weights), wrong)
    with (
        weight_updates(collector, "between_batches"),
        pytest.raises(WeightSyncError, match="probe"),
    ):
        collector.apply_pending_weights()
    assert collector.policy_version == version


@pytest.mark.slow
def test_checksum_mismatch_fails_and_stale_versions_are_ignored(engines):
    model_dir, collector = engines["tied"]
    with weight_updates(collector, "between_batches"):
        checksum_mismatch_fails_between_batches(model_dir, collector)


def checksum_mismatch_fails_between_batches(model_dir, collector):
    model, hf_config = trainer_side(model_dir)
    weights = hf_weights(model, hf_config)
    version = collector.policy_version
    assert collector.receive_weights(weights, version + 1, "0" * 64)
    with pytest.raises(WeightSyncError, match="checksum"):
        collector.generate_batch(1)
    assert collector.policy_version == version
    # The engine holds weights that failed verification: it refuses to generate or evaluate.
    with pytest.raises(WeightSyncError, match="unverified"):
        collector.generate_batch(1)
    with pytest.raises(WeightSyncError, match="unverified"):
        collector.evaluate([collector.dataset[0]])
    assert collector.rollout_queue.empty()

    # Recovery: the next correct update is applied and labels the samples.
    assert collector.receive_weights(weights, version + 2, state_dict_checksum(weights))
    trajectories = generated_trajectories(collector, num_prompts=1)
    assert {t.policy_version for t in trajectories} == {version + 2}
    assert max_logprob_error(model, trajectories) < 1e-3

    assert not collector.receive_weights(weights, version + 1, state_dict_checksum(weights))
    assert not collector.weights.has_pending


@pytest.mark.slow
def test_weights_reach_a_collector_actor_between_batches(engines, ray_cluster):
    """The production path: a collector Ray actor, weights put once, applied between batches."""
    from ray.util.queue import Queue

    from grpo.workers.collector import InferenceConfig, SyncLLMCollector

    model_dir, _ = engines["tied"]
    model, hf_config = trainer_side(model_dir)
    rollout_queue = Queue(maxsize=2)
    actor = SyncLLMCollector.as_remote(num_cpus=1).remote(
        worker_id=0,
        num_workers=1,
        model_dir=str(model_dir),
        dataset={"_component_": "grpo.data.arithmetic_dataset", "num_examples": 8},
        rollout_queue=rollout_queue,
        config=InferenceConfig(
            engine_args=ENGINE_ARGS,
            group_size=GROUP_SIZE,
            max_generated_tokens=MAX_GENERATED_TOKENS,
            queue_put_timeout_s=0.5,
            max_prompt_tokens=64,
        ),
        reward_functions=[MathCorrectnessReward()],
    )
    try:
        ray = ray_cluster
        ray.get(actor.generate_batch.remote(1))
        perturb(model, seed=7)
        weights = hf_weights(model, hf_config)
        # As in a run: the weights go into the object store once, the actor gets the reference.
        weights_ref = ray.put(weights)
        checksum = state_dict_checksum(weights)
        assert ray.get(actor.receive_weights.remote(weights_ref, 1, checksum)) is True
        metrics = ray.get(actor.generate_batch.remote(1))
        assert metrics["inference/policy_version"] == 1
        assert metrics["inference/time_weight_update (s)"] > 0
        assert ray.get(actor.get_weights_checksum.remote()) == state_dict_checksum(weights)
        groups = [rollout_queue.get(timeout=30) for _ in range(2)]
        assert [g.trajectories[0].policy_version for g in groups] == [0, 1]
        assert max_logprob_error(model, groups[1].trajectories) < 1e-3
        # A threaded actor takes weights while a batch waits on the full queue.
        blocked = actor.generate_batch.remote(3)
        deadline = time.monotonic() + 60
        while rollout_queue.size() < 2:
            assert time.monotonic() < deadline, "the batch queued no groups"
            time.sleep(0.05)
        time.sleep(1.0)  # longer than queue_put_timeout_s: the third put has waited at least once
        assert ray.get(actor.receive_weights.remote(weights_ref, 2, checksum), timeout=30)
        assert ray.wait([blocked], timeout=0)[0] == []
        assert len([rollout_queue.get(timeout=30) for _ in range(3)]) == 3
        metrics = ray.get(blocked, timeout=60)
        assert metrics["queues/rollout_queue_put_waits"] >= 1
        assert metrics["inference/policy_version"] == 1  # version 2 waits for the next batch
    finally:
        ray_cluster.kill(actor)


def scored_batch(num_sequences: int = 4, vocab_size: int = 200) -> list:
    from grpo.types import ScoredTrajectory

    generator = torch.Generator().manual_seed(0)
    return [
        ScoredTrajectory(
            prompt_tokens=torch.randint(0, vocab_size, (4,), generator=generator),
            response_tokens=torch.randint(0, vocab_size, (6,), generator=generator),
            prompt_len=4,
            response_len=6,
            logprobs=-torch.rand(6, generator=generator) * 6,
            ref_logprobs=-torch.rand(6, generator=generator) * 6,
            rewards=torch.tensor([float(i % 2)]),
            advantages=torch.randn((), generator=generator),
            successes=torch.tensor([float(i % 2)]),
            answer="1",
            sequence_id=f"s{i}",
            group_id=i // 2,
            reward_metadata={"func_names": ["toy"]},
            policy_version=0,
        )
        for i in range(num_sequences)
    ]


@pytest.mark.slow
def test_collective_sync_from_a_trainer_actor_and_a_replacement_joins_a_new_pair(
    engines, ray_cluster
):
    """The collective transport end to end over gloo: a trainer actor broadcasts to a collector
    actor; checksum and probe hold, versions stay in order, and a collector that died is
    replaced by one that catches up over a new channel and gets the next weights through it."""
    from ray.util.queue import Queue

    from grpo.config import WeightSyncConfig
    from grpo.testing.faults import delay_next_weight_send
    from grpo.weights.concurrency import TRAINER_CONCURRENCY_GROUPS
    from grpo.weights.sync import WeightSync
    from grpo.workers.collector import InferenceConfig, SyncLLMCollector
    from grpo.workers.trainer import PyTorchActorModel, TrainingConfig

    ray = ray_cluster
    model_dir, _ = engines["tied"]
    trainer = ray.remote(num_cpus=0.5, concurrency_groups=TRAINER_CONCURRENCY_GROUPS)(
        PyTorchActorModel
    ).remote(
        rank=0,
        world_size=1,
        model_dir=str(model_dir),
        num_steps=8,
        target_tokens_per_batch=256,
        pad_token_id=0,
        config=TrainingConfig(optimizer={"_component_": "torch.optim.SGD", "lr": 1.0}),
    )

    def new_collector():
        return SyncLLMCollector.as_remote(num_cpus=0.5).remote(
            worker_id=0,
            num_workers=1,
            model_dir=str(model_dir),
            dataset={"_component_": "grpo.data.arithmetic_dataset", "num_examples": 8},
            rollout_queue=Queue(maxsize=8),
            config=InferenceConfig(
                engine_args=ENGINE_ARGS,
                group_size=GROUP_SIZE,
                max_generated_tokens=MAX_GENERATED_TOKENS,
                max_prompt_tokens=64,
            ),
            reward_functions=[MathCorrectnessReward()],
        )

    collector = new_collector()
    # Small buckets: the tiny model's weights go in several broadcasts.
    config = WeightSyncConfig(transport="collective", bucket_mb=0.05, timeout_s=30)
    sync = WeightSync(lambda refs, what: ray.get(refs), wait_for_receipt=True, config=config)
    batch = ray.put(scored_batch())
    try:
        ray.get(trainer.setup.remote())
        base_checksum = ray.get(trainer.weights_checksum.remote())
        ray.get(trainer.train_step.remote(batch))
        version, timings = sync.sync([trainer], [collector])
        assert version == 1 and timings["training_perf/time_weight_transfer (s)"] > 0
        # Applying checks the worker's checksum and the trainer's probe logprobs.
        assert ray.get(collector.apply_pending_weights.remote()) > 0
        expected = ray.get(trainer.weights_checksum.remote())
        assert expected != base_checksum
        assert ray.get(collector.get_weights_checksum.remote()) == expected

        # Two syncs back to back without waiting: the channel keeps them in order.
        sync.wait_for_receipt = False
        ray.get(trainer.train_step.remote(batch))
        sync.sync([trainer], [collector])
        ray.get(trainer.train_step.remote(batch))
        assert sync.sync([trainer], [collector])[0] == 3
        assert sync.verify([trainer], [collector])
        assert ray.get(collector.get_policy_version.remote()) == 3

        # A send whose thread starts late (a busy machine) is finished before the next gather
        # replaces the version the trainer holds: no transfer fails, none is sent again.
        ray.get(trainer.__ray_call__.remote(delay_next_weight_send))
        ray.get(trainer.train_step.remote(batch))
        sync.sync([trainer], [collector])
        ray.get(trainer.train_step.remote(batch))
        sync.sync([trainer], [collector])
        ray.get(trainer.train_step.remote(batch))
        assert sync.sync([trainer], [collector])[0] == 6
        assert sync.verify([trainer], [collector])
        assert ray.get(collector.get_policy_version.remote()) == 6
        assert sync.retries == 0

        # A dead collector's replacement joins a new pair, catches up, then takes the next sync.
        ray.kill(collector, no_restart=True)
        collector = new_collector()
        sync.catch_up(collector, None, "inference[0]")
        assert sync.verify([trainer], [collector])
        assert ray.get(collector.get_policy_version.remote()) == 6
        ray.get(trainer.train_step.remote(batch))
        sync.wait_for_receipt = True
        assert sync.sync([trainer], [collector])[0] == 7
        assert sync.verify([trainer], [collector])
        assert ray.get(collector.get_policy_version.remote()) == 7
    finally:
        ray.kill(collector)
        ray.kill(trainer)


@pytest.mark.slow
def test_object_store_sync_from_a_trainer_actor_builds_only_its_own_ends(
    engines, ray_cluster, monkeypatch
):
    """The driver makes the same calls for the object store as for the collective transport:
    the trainer's reference reaches the collector, checksum and probe hold, and each actor
    holds the end of that transport only."""
    from ray.util.queue import Queue

    from grpo.config import WeightSyncConfig
    from grpo.weights.concurrency import TRAINER_CONCURRENCY_GROUPS
    from grpo.weights.sync import WeightSync
    from grpo.workers.collector import InferenceConfig, SyncLLMCollector
    from grpo.workers.trainer import PyTorchActorModel, TrainingConfig

    ray = ray_cluster
    model_dir, _ = engines["tied"]
    trainer = ray.remote(num_cpus=0.5, concurrency_groups=TRAINER_CONCURRENCY_GROUPS)(
        PyTorchActorModel
    ).remote(
        rank=0,
        world_size=1,
        model_dir=str(model_dir),
        num_steps=8,
        target_tokens_per_batch=256,
        pad_token_id=0,
        config=TrainingConfig(optimizer={"_component_": "torch.optim.SGD", "lr": 1.0}),
    )
    collector = SyncLLMCollector.as_remote(num_cpus=0.5).remote(
        worker_id=0,
        num_workers=1,
        model_dir=str(model_dir),
        dataset={"_component_": "grpo.data.arithmetic_dataset", "num_examples": 8},
        rollout_queue=Queue(maxsize=8),
        config=InferenceConfig(
            engine_args=ENGINE_ARGS,
            group_size=GROUP_SIZE,
            max_generated_tokens=MAX_GENERATED_TOKENS,
            max_prompt_tokens=64,
        ),
        reward_functions=[MathCorrectnessReward()],
    )
    config = WeightSyncConfig(transport="object_store")
    sync = WeightSync(lambda refs, what: ray.get(refs), wait_for_receipt=True, config=config)
    batch = ray.put(scored_batch())
    asked, actor_state = [], ray._private.state.actors
    monkeypatch.setattr(
        ray._private.state, "actors", lambda key: asked.append(key) or actor_state(key)
    )
    try:
        ray.get(trainer.setup.remote())
        ray.get(trainer.train_step.remote(batch))
        assert sync.sync([trainer], [collector])[0] == 1
        ray.get(trainer.train_step.remote(batch))
        assert sync.sync([trainer], [collector])[0] == 2
        assert sync.verify([trainer], [collector])
        assert len(asked) == 1  # whether it started: once, not at every sync
        assert ray.get(collector.get_policy_version.remote()) == 2
        ends = [
            ray.get(trainer.__ray_call__.remote(lambda t: type(t.weight_sender).__name__)),
            ray.get(collector.__ray_call__.remote(lambda c: type(c.weights.end).__name__)),
        ]
        assert ends == ["ObjectStoreSender", "ObjectStoreReceiver"]
    finally:
        ray.kill(collector)
        ray.kill(trainer)
