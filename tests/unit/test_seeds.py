"""Sampling seeds: every (group, episode, turn) request of a run has its own, reproducibly."""

import pytest

from grpo.envs import PlainTurnRenderer, Sample, run_episodes
from grpo.models import load_tokenizer
from grpo.seeds import SEED_BITS, group_seed, mix_seed, sample_seed
from grpo.testing.tools import EchoUserEnv

GROUP_SIZE = 4
PROMPTS_PER_BATCH = 3
MAX_TURNS = 3


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def multi_turn_seeds(tokenizer, run_seed: int, num_batches: int = 2) -> list[int]:
    """The seed of every policy turn of consecutive batches of multi-turn groups, in order."""
    seeds = []
    # One token that neither stops nor closes a turn: every episode runs MAX_TURNS turns.
    [token] = tokenizer.encode("a", add_bos=False, add_eos=False)

    def sample(requests):
        seeds.extend(request.seed for request in requests)
        return [Sample([token], [-1.0], "stop") for _ in requests]

    env = EchoUserEnv(max_turns=MAX_TURNS, reward_functions=[])
    group_ids = iter(range(10**6))
    for _ in range(num_batches):
        prompts = [
            ({"question": f"q{k}", "answer": "1", "index": k}, [1, 2, 3 + k])
            for k in range(PROMPTS_PER_BATCH)
        ]
        groups = run_episodes(
            env,
            sample,
            tokenizer,
            PlainTurnRenderer(tokenizer),
            prompts,
            group_size=GROUP_SIZE,
            max_tokens_per_turn=4,
            max_model_len=512,
            seeds=[group_seed(run_seed, next(group_ids)) for _ in prompts],
        )
        assert all(e.num_turns == MAX_TURNS for group in groups for e in group)
    return seeds


def test_every_turn_of_every_episode_of_consecutive_batches_has_its_own_seed(tokenizer):
    seeds = multi_turn_seeds(tokenizer, run_seed=0)
    assert len(seeds) == 2 * PROMPTS_PER_BATCH * GROUP_SIZE * MAX_TURNS
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= seed < 2**SEED_BITS for seed in seeds)
    # The same run seed samples with the same seeds; another run seed with others.
    assert multi_turn_seeds(tokenizer, run_seed=0) == seeds
    assert set(multi_turn_seeds(tokenizer, run_seed=1)).isdisjoint(seeds)


def test_first_turns_are_the_seeds_vllm_gives_the_samples_of_a_group_request():
    """Episode ``j`` of a group samples its first turn with the group's seed + ``j``, the seed
    vLLM gives sample ``j`` of one request of ``n = group_size`` samples: a group sampled as
    one request or as ``group_size`` turns samples the same."""
    base = group_seed(7, 12)
    assert [sample_seed(base, member, 0) for member in range(4)] == [base + j for j in range(4)]
    assert sample_seed(base, 1, 1) not in {sample_seed(base, j, 0) for j in range(4)}
    assert mix_seed(1, 2) != mix_seed(2, 1)  # order-sensitive
    assert group_seed(0, 1) != group_seed(1, 0)
