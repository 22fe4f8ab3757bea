"""Sampling seeds: one per (group, episode, turn), derived from the run seed.

Seeded requests let a resumed stream sample exactly what the interrupted one would have; the
seeds must also be distinct, or episodes of a group (or turns of an episode) copy each other's
randomness. vLLM seeds the ``n`` samples of a request ``seed .. seed + n - 1``, so episode ``j``
of a group starts at ``group_seed + j`` and later turns hash the turn in: with a stride instead,
turn ``t`` of group ``k`` would land on turn 0 of group ``k + t``. Seeds are 62-bit, so two
groups' runs overlap with probability about ``group_size / 2**61``. Pure Python.
"""

from __future__ import annotations

SEED_BITS = 62
_MASK64 = 2**64 - 1


def _splitmix64(value: int) -> int:
    """One step of the splitmix64 generator: a bijective, well-mixed 64-bit hash."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def mix_seed(*parts: int) -> int:
    """Hash integers (any sign, any size) into a seed in ``[0, 2**SEED_BITS)``, order-sensitively."""
    state = 0
    for part in parts:
        state = _splitmix64(state ^ (int(part) & _MASK64))
    return state >> (64 - SEED_BITS)


def group_seed(run_seed: int, group_id: int) -> int:
    """The seed of a group's first request: a hash of the run seed and its group id (unique
    across collectors); episode ``j``'s first turn samples with ``sample_seed(seed, j, 0)``."""
    return mix_seed(run_seed, group_id)


def turn_seed(first_turn_seed: int, turn: int) -> int:
    """The seed of policy turn ``turn`` of an episode whose first turn samples with
    ``first_turn_seed`` (`grpo.envs.Episode.seed`).

    Turn 0 is ``first_turn_seed`` itself; a later turn hashes the turn in, so it repeats no
    seed of this episode, of its group or of any other group.
    """
    return first_turn_seed if turn == 0 else mix_seed(first_turn_seed, turn)


def choice_seed(seed: int, choice: int) -> int:
    """The seed of answer ``choice`` of a policy turn sampled several times (an agent's call
    with ``n`` above 1, `grpo.envs.AgentEnv`), whose own seed is ``seed``.

    Choice 0 is the turn's own seed. A later choice hashes in a negative tag, which no turn
    number takes, so choice ``i`` of a first turn is not that episode's turn ``i``.
    """
    return seed if choice == 0 else mix_seed(seed, -1 - choice)


def sample_seed(group: int, member: int, turn: int) -> int:
    """The seed of policy turn ``turn`` of episode ``member`` of a group.

    Turn 0 is ``group + member``, what vLLM gives sample ``member`` of one request of ``n``
    samples seeded with ``group``; later turns: `turn_seed`.
    """
    return turn_seed((group + member) % 2**SEED_BITS, turn)
