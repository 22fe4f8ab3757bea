"""SyncLLMCollector on a tiny Qwen2 with vLLM on CPU: groups, logprobs, shards, queue bound."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from grpo.data import PromptStream, arithmetic_dataset
from grpo.rewards import MathCorrectnessReward

pytestmark = pytest.mark.slow

GROUP_SIZE = 4
MAX_GENERATED_TOKENS = 12
NUM_EXAMPLES = 24
ENGINE_ARGS = {"kv_cache_memory_bytes": 64 * 2**20}


@pytest.fixture(scope="module")
def dataset():
    # unique: every prompt text is distinct, so "disjoint shards" can be checked on prompts.
    return arithmetic_dataset(num_examples=NUM_EXAMPLES, seed=0, unique=True)


def make_collector(model_dir, dataset, worker_id, num_workers):
    from grpo.workers.collector import InferenceConfig, SyncLLMCollector

    config = InferenceConfig(
        engine_args=ENGINE_ARGS,
        group_size=GROUP_SIZE,
        max_generated_tokens=MAX_GENERATED_TOKENS,
        temperature=1.0,
        top_p=1.0,
        queue_put_timeout_s=0.2,
        max_prompt_tokens=64,
    )
    return SyncLLMCollector(
        worker_id,
        num_workers,
        model_dir,
        dataset,
        queue.Queue(),
        config,
        seed=0,
        reward_functions=[MathCorrectnessReward()],
    )


@pytest.fixture(scope="module")
def collectors(tiny_model_dir, dataset):
    # Two engines in one process share vLLM's global state: both live for the whole module and
    # are shut down together at the end (see SyncLLMCollector.shutdown).
    first = make_collector(tiny_model_dir, dataset, worker_id=0, num_workers=2)
    second = make_collector(tiny_model_dir, dataset, worker_id=1, num_workers=2)
    yield first, second
    second.shutdown()
    first.shutdown()


@pytest.fixture(scope="module")
def collector(collectors):
    return collectors[0]


@pytest.fixture(scope="module")
def tune_model(tiny_model_dir):
    from grpo.models import build_model

    return build_model(tiny_model_dir, dtype=torch.float32).eval()


def drain(rollout_queue, count, timeout=30.0):
    return [rollout_queue.get(timeout=timeout) for _ in range(count)]


def upcoming_prompts(collector, count):
    """The examples the collector's stream yields next, read from a copy of its state."""
    stream = PromptStream(collector.dataset, collector.worker_id, collector.num_workers, seed=0)
    stream.load_state_dict(collector.stream.state_dict())
    return stream.next_batch(count)


def torchtune_response_logprobs(model, trajectory):
    tokens = torch.cat([trajectory.prompt_tokens, trajectory.response_tokens])
    with torch.no_grad():
        logits = model(tokens[None])[0].float()
    # The logprob of token t is read from the logits at t - 1.
    logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(-1, tokens[1:, None])[:, 0]
    return logprobs[trajectory.prompt_len - 1 :]


def test_groups_have_the_expected_structure(collector):
    expected_items = upcoming_prompts(collector, 3)
    first_group_counter = collector.group_counter
    metrics = collector.generate_batch(3)
    groups = drain(collector.rollout_queue, 3)
    assert collector.rollout_queue.empty()

    stop_tokens = set(collector.tokenizer.stop_tokens)
    sequence_ids = set()
    for k, (group, item) in enumerate(zip(groups, expected_items)):
        assert group.group_id == 0 + 2 * (first_group_counter + k)  # worker 0 of 2: even ids
        assert len(group.trajectories) == GROUP_SIZE
        expected_prompt = collector.tokenizer.encode(item["prompt"], add_bos=True, add_eos=False)
        for trajectory in group.trajectories:
            assert trajectory.prompt_tokens.tolist() == expected_prompt
            assert trajectory.answer == item["answer"]
            assert trajectory.policy_version == 0
            assert trajectory.group_id == group.group_id
            assert 1 <= trajectory.response_len <= MAX_GENERATED_TOKENS
            assert trajectory.response_len == len(trajectory.response_tokens)
            assert trajectory.response_len == len(trajectory.logprobs)
            assert bool(trajectory.logprobs.isfinite().all())
            assert bool((trajectory.logprobs <= 0).all())
            response = trajectory.response_tokens.tolist()
            # No padding and nothing after a stop token; a stop token, if any, is kept last.
            assert not stop_tokens & set(response[:-1])
            if trajectory.response_len < MAX_GENERATED_TOKENS:
                text = collector.tokenizer.decode(response)
                assert response[-1] in stop_tokens or any(
                    s in text for s in collector.sampling.stop
                )
            assert trajectory.sequence_id.startswith("w0-")
            sequence_ids.add(trajectory.sequence_id)
        assert group.total_tokens == sum(t.prompt_len + t.response_len for t in group.trajectories)
    assert len(sequence_ids) == 3 * GROUP_SIZE

    generated = sum(t.response_len for g in groups for t in g.trajectories)
    assert metrics["inference/generated_tokens"] == generated
    assert metrics["inference/response_length_mean"] == pytest.approx(generated / (3 * GROUP_SIZE))
    assert metrics["inference/num_groups"] == 3
    # What the driver logs for the batch (under the inference step).
    for key in (
        "inference/tokens_per_second",
        "inference/time_generation (s)",
        "inference/time_weight_update (s)",
        "inference/policy_version",
        "inference/response_length_mean",
        "queues/rollout_queue_put_wait_s",
        "queues/rollout_queue_put_waits",
    ):
        assert key in metrics, key


def test_an_eager_cpu_engine_samples_without_compiling(collector):
    """vLLM's sampler ``torch.compile``s a helper (the sampled token's rank) on its first step:
    seconds of tracing and a C++ build in every collector. An eager engine on CPU steps with
    Dynamo off, so sampling a batch compiles no frame."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # an engine an earlier test stepped itself may have compiled it
    compiled_before = counters["frames"]["ok"]
    collector.generate_batch(2)
    drain(collector.rollout_queue, 2)
    assert counters["frames"]["ok"] == compiled_before


def test_behaviour_logprobs_match_a_torchtune_forward(collector, tune_model):
    collector.generate_batch(2)
    groups = drain(collector.rollout_queue, 2)
    max_diff = 0.0
    for group in groups:
        for trajectory in group.trajectories:
            expected = torchtune_response_logprobs(tune_model, trajectory)
            max_diff = max(max_diff, float((expected - trajectory.logprobs).abs().max()))
    assert max_diff < 1e-3, max_diff


def test_sampling_is_seeded_and_resumes_exactly(collector):
    state = collector.state_dict()
    collector.generate_batch(2)
    first = drain(collector.rollout_queue, 2)
    collector.generate_batch(2)
    later = drain(collector.rollout_queue, 2)

    collector.load_state_dict(state)
    collector.generate_batch(2)
    again = drain(collector.rollout_queue, 2)
    for a, b in zip(first, again):
        assert a.group_id == b.group_id
        for ta, tb in zip(a.trajectories, b.trajectories):
            assert ta.sequence_id == tb.sequence_id
            assert torch.equal(ta.prompt_tokens, tb.prompt_tokens)
            assert torch.equal(ta.response_tokens, tb.response_tokens)
            torch.testing.assert_close(ta.logprobs, tb.logprobs)
    # The samples of one prompt differ from each other, and later batches move on.
    assert len({tuple(t.response_tokens.tolist()) for t in first[0].trajectories}) > 1
    assert {g.group_id for g in later}.isdisjoint(g.group_id for g in first)
    with pytest.raises(ValueError, match="worker_id"):
        collector.load_state_dict({**state, "worker_id": 1})


def test_a_restored_collector_labels_its_samples_with_the_weights_it_holds(collector):
    """A resumed run, or one restarted from a checkpoint after a trainer died, starts its
    collectors from the checkpoint's weights (the constructor's ``policy_version``) and
    loads each one's state after its last batch, whose version may be older: the samples
    must carry the version of the weights the engine holds, or the buffer drops fresh
    samples as stale (with ``max_policy_lag: 0``, every one, for ever)."""
    state = collector.state_dict()
    held = collector.policy_version
    try:
        collector.load_state_dict({**state, "policy_version": held + 7})
        collector.generate_batch(1)
        (group,) = drain(collector.rollout_queue, 1)
        versions = {(t.policy_version, t.last_policy_version) for t in group.trajectories}
        assert versions == {(held, held)}
        assert collector.state_dict()["policy_version"] == held
    finally:
        collector.load_state_dict(state)


def test_two_workers_read_disjoint_shards(collectors, dataset):
    prompts_by_worker, group_ids_by_worker = [], []
    for worker in collectors:
        worker.load_state_dict({**worker.state_dict(), "stream": {"epoch": 0, "position": 0}})
        shard_size = len(worker.stream)
        worker.generate_batch(shard_size)  # one full epoch of the shard
        groups = drain(worker.rollout_queue, shard_size)
        prompts_by_worker.append({tuple(g.trajectories[0].prompt_tokens.tolist()) for g in groups})
        group_ids_by_worker.append({g.group_id for g in groups})
        assert len(prompts_by_worker[-1]) == shard_size
    assert prompts_by_worker[0].isdisjoint(prompts_by_worker[1])
    assert group_ids_by_worker[0].isdisjoint(group_ids_by_worker[1])
    all_prompts = {
        tuple(collectors[0].tokenizer.encode(dataset[i]["prompt"], add_bos=True, add_eos=False))
        for i in range(len(dataset))
    }
    assert prompts_by_worker[0] | prompts_by_worker[1] == all_prompts


def test_the_rollout_queue_imports_what_it_holds_as_it_starts(ray_cluster):
    # Groups unpickle into torch tensors: the queue's actor imports them while the run starts,
    # so the collector's first put (which waits for it) waits for no import.
    from grpo.workers.rollout_queue import RolloutQueue

    def imported(actor):
        import sys

        return "grpo.types" in sys.modules

    rollout_queue = RolloutQueue()
    try:
        assert ray_cluster.get(rollout_queue.actor.__ray_call__.remote(imported), timeout=120)
    finally:
        ray_cluster.kill(rollout_queue.actor)


@pytest.mark.parametrize("queue_kind", ["ray_queue", "rollout_queue"])
def test_full_ray_queue_blocks_the_collector_and_loses_nothing(collector, ray_cluster, queue_kind):
    # ray's Queue takes one put per group; RolloutQueue the whole batch with `put_all`, which
    # returns how many fitted before a timeout, and the collector retries the rest.
    from ray.util.queue import Queue

    from grpo.workers.rollout_queue import RolloutQueue

    try:
        rollout_queue = (Queue if queue_kind == "ray_queue" else RolloutQueue)(maxsize=2)
        collector.rollout_queue = rollout_queue
        num_prompts = 5
        waits_before = collector.totals["queue_put_waits"]
        result: dict = {}
        worker = threading.Thread(
            target=lambda: result.update(collector.generate_batch(num_prompts)), daemon=True
        )
        worker.start()
        # No consumer yet: the collector must stop at maxsize and keep retrying its put.
        deadline = time.monotonic() + 90
        while collector.totals["queue_put_waits"] - waits_before < 3:
            assert rollout_queue.size() <= 2
            assert time.monotonic() < deadline, "the collector never waited on the full queue"
            time.sleep(0.05)
        assert rollout_queue.size() == 2
        assert worker.is_alive()

        received = []
        while len(received) < num_prompts:
            assert rollout_queue.size() <= 2
            received.append(rollout_queue.get(timeout=30))
            time.sleep(0.1)  # a slow consumer: the collector keeps hitting the bound
        worker.join(timeout=30)
        assert not worker.is_alive()
        assert rollout_queue.empty()
        group_ids = [g.group_id for g in received]
        assert len(set(group_ids)) == num_prompts and group_ids == sorted(group_ids)
        assert all(len(g.trajectories) == GROUP_SIZE for g in received)
        assert result["inference/num_groups"] == num_prompts
        assert result["inference/groups_not_queued"] == 0
        assert result["queues/rollout_queue_put_waits"] >= 3
        assert result["queues/rollout_queue_put_wait_s"] >= 3 * collector.queue_put_timeout_s * 0.9
    finally:
        collector.rollout_queue = queue.Queue()


def test_evaluate_is_greedy_decoding(collector, tune_model, dataset):
    items = [dataset[i] for i in range(3)]
    completions = collector.evaluate(items, max_generated_tokens=8)
    assert completions == collector.evaluate(items, max_generated_tokens=8)

    stop_tokens = set(collector.tokenizer.stop_tokens)
    for item, completion in zip(items, completions):
        tokens = collector.tokenizer.encode(item["prompt"], add_bos=True, add_eos=False)
        generated = []
        with torch.no_grad():
            for _ in range(8):
                next_token = int(tune_model(torch.tensor([tokens + generated]))[0, -1].argmax())
                generated.append(next_token)
                text = collector.tokenizer.decode(generated)
                if next_token in stop_tokens or any(s in text for s in collector.sampling.stop):
                    break
        assert completion == collector.tokenizer.decode(generated, skip_special_tokens=True)


def test_continuous_turns_sample_what_a_batch_samples(collector, dataset):
    """The engine as a `TurnEngine`: a turn submitted while others run joins them, and every
    turn gets the tokens and logprobs a batch ``generate`` of the same request gets."""
    from vllm.inputs import TokensPrompt

    from grpo.envs import SampleRequest
    from grpo.workers.vllm_engine import sampled_logprobs

    requests = [
        SampleRequest(collector.environment.prompt_ids(dataset[i]), 10, 1000 + i, ())
        for i in range(4)
    ]
    with collector.engine.lock:
        engine = collector.engine.turn_engine()
        keys = [engine.submit(request) for request in requests[:3]]
        finished = dict(engine.step())  # prefill and the first token of the three
        keys.append(engine.submit(requests[3]))  # joins the running batch
        steps = 1
        while len(finished) < 4:
            finished.update(engine.step())
            steps += 1
        outputs = collector.llm.generate(
            [TokensPrompt(prompt_token_ids=r.token_ids) for r in requests],
            [collector.sampling.params(r.seed, r.max_tokens, r.stop) for r in requests],
            use_tqdm=False,
        )
    assert steps <= 10 + 2  # the fourth turn ran beside the others, not after them
    for key, output in zip(keys, outputs):
        sample, [batched] = finished[key], output.outputs
        assert sample.token_ids == list(batched.token_ids)
        assert sample.logprobs == pytest.approx(sampled_logprobs(batched, "batch"), abs=1e-4)
        assert sample.finish_reason == batched.finish_reason


def test_consecutive_batches_sample_with_distinct_seeds_derived_from_the_run_seed(collector):
    """Every sample of two consecutive batches has its own seed: ``sample_seed`` of its
    group's hashed seed, the same for the same run seed and group."""
    from grpo.seeds import group_seed, sample_seed

    requests = []
    add_request = collector.engine.add_request

    def recording(request_id, token_ids, params):
        requests.append((params.seed, params.n))
        return add_request(request_id, token_ids, params)

    collector.engine.add_request = recording
    group_ids = []
    try:
        for _ in range(2):
            collector.generate_batch(3)
            group_ids += [g.group_id for g in drain(collector.rollout_queue, 3)]
    finally:
        del collector.engine.add_request
    # One request per sample (a policy turn), each with a seed of its own.
    assert len(requests) == 6 * GROUP_SIZE and all(n == 1 for _, n in requests)
    seeds = [seed for seed, _ in requests]
    assert len(set(seeds)) == len(seeds)
    assert sorted(seeds) == sorted(
        sample_seed(group_seed(collector.seed, group_id), member, 0)
        for group_id in group_ids
        for member in range(GROUP_SIZE)
    )


def test_behaviour_and_trainer_logprobs_are_those_of_the_sampling_temperature(
    collector, tiny_model_dir
):
    """At temperature 0.7 the engine samples from softmax(logits / 0.7): its behaviour
    logprobs and the trainer's (logits divided by the temperature) are that distribution's,
    so the trainer's mismatch KL is as small as at temperature 1. The trainer's logprobs of
    the raw logits are far from them."""
    from grpo.types import ScoredTrajectory
    from grpo.workers.trainer import PyTorchActorModel, TrainingConfig

    loss = {"_component_": "grpo.objective.loss.GRPOLoss", "kl_coeff": 0.0}
    config = TrainingConfig(optimizer={"_component_": "torch.optim.SGD", "lr": 1e-9}, loss=loss)
    trainer = PyTorchActorModel(
        rank=0,
        world_size=1,
        model_dir=str(tiny_model_dir),
        num_steps=4,
        target_tokens_per_batch=1024,
        pad_token_id=collector.tokenizer.pad_id,
        config=config,
    )
    trainer.setup()

    def mismatch_kl(trainer_temperature, trajectories):
        trainer.temperature = trainer_temperature
        batch = [
            ScoredTrajectory(
                prompt_tokens=t.prompt_tokens,
                response_tokens=t.response_tokens,
                prompt_len=t.prompt_len,
                response_len=t.response_len,
                logprobs=t.logprobs,
                ref_logprobs=None,
                rewards=torch.zeros(1),
                advantages=torch.zeros(()),
                successes=torch.zeros(1),
                answer=t.answer,
                sequence_id=t.sequence_id,
                group_id=t.group_id,
                reward_metadata={"func_names": ["none"]},
                policy_version=0,
            )
            for t in trajectories
        ]
        return trainer.train_step(batch)["training/mismatch_kl"]

    kl = {}
    sampling = collector.engine.sampling
    try:
        for temperature in (0.7, 1.0):
            collector.engine.sampling = sampling._replace(temperature=temperature)
            collector.generate_batch(3)
            trajectories = [t for g in drain(collector.rollout_queue, 3) for t in g.trajectories]
            kl[temperature] = mismatch_kl(temperature, trajectories)
            if temperature != 1.0:
                kl["raw logits at 0.7"] = mismatch_kl(1.0, trajectories)
    finally:
        # No trainer.shutdown(): world_size 1 joined no process group, and the default one
        # in this process is the engine's.
        collector.engine.sampling = sampling
    assert kl[0.7] < 1e-6 and kl[1.0] < 1e-6, kl
    assert kl[0.7] < 10 * kl[1.0] + 1e-8, kl
    assert kl["raw logits at 0.7"] > 1e-2, kl


def test_an_episode_is_not_cut_to_one_turn_when_max_model_len_is_unset(tiny_model_dir):
    """Without ``max_model_len`` a collector sizes the engine's context for a whole episode
    (``max_prompt_tokens + max_episode_tokens``), not for one turn: the episode runs several
    turns and ends at its own bound."""
    from grpo.envs import PlainTurnRenderer, Sample, SingleTurnEnv, run_episodes
    from grpo.models import load_tokenizer
    from grpo.testing.tools import EchoUserEnv

    tokenizer = load_tokenizer(tiny_model_dir)
    [token] = tokenizer.encode("a", add_bos=False, add_eos=False)
    env = EchoUserEnv(max_turns=20, max_episode_tokens=48, reward_functions=[])
    assert env.response_budget(8) == 48
    assert EchoUserEnv(reward_functions=[]).response_budget(8) is None  # the model's context
    assert SingleTurnEnv([MathCorrectnessReward()]).response_budget(8) == 8

    def sample(requests):
        return [
            Sample([token] * min(6, r.max_tokens), [-1.0] * min(6, r.max_tokens), "stop")
            for r in requests
        ]

    prompt = [1, 2, 3]
    [[episode]] = run_episodes(
        env,
        sample,
        tokenizer,
        PlainTurnRenderer(tokenizer),
        [({"question": "q", "answer": "1", "index": 0}, prompt)],
        group_size=1,
        max_tokens_per_turn=8,
        max_model_len=len(prompt) + env.response_budget(8),
        seeds=[0],
    )
    assert episode.num_turns > 2 and episode.truncated
    assert 8 < len(episode.response_ids) <= 48


def test_a_turn_is_detokenized_only_to_find_its_stop_strings(collector, dataset):
    """vLLM decodes text token by token only for a turn with stop strings (the text is never
    read, only the tokens); a turn with a stop string still ends at it."""
    from vllm.inputs import TokensPrompt

    from grpo.workers.vllm_engine import Sampling

    sampling = Sampling(temperature=1.0, top_p=1.0)
    assert sampling.params(0, 8).detokenize is False
    prompt = TokensPrompt(prompt_token_ids=collector.environment.prompt_ids(dataset[0]))
    with collector.engine.lock:
        [free] = collector.llm.generate(prompt, sampling.params(7, 16), use_tqdm=False)
        tokens = list(free.outputs[0].token_ids)
        # A stop string the free turn wrote after its first token: the same seed stops there.
        text = collector.tokenizer.decode(tokens)
        stop = text[len(collector.tokenizer.decode(tokens[:1])) :][:1]
        assert stop, text
        params = sampling.params(7, 16, extra_stop=(stop,))
        assert params.detokenize is True
        [stopped] = collector.llm.generate(prompt, params, use_tqdm=False)
    assert stopped.outputs[0].finish_reason == "stop"
    assert len(stopped.outputs[0].token_ids) < len(tokens)
