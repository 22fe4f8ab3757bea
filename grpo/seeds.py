"""Sampling seeds: one per (group, episode, turn), derived from the run seed.

Every request a collector sends to its engine carries a seed, so that a resumed stream samples
exactly what the interrupted one would have. The seeds must also be distinct: two requests
with one seed and the same tokens sample the same continuation, which makes the episodes of a
group, or the turns of one episode, copies of each other's randomness.

A group's seed is a hash of ``(run seed, group id)`` (`group_seed`). vLLM gives the ``n``
samples of a request the seeds ``seed, seed + 1, ..., seed + n - 1``, so episode ``j`` of a
group samples its first turn with ``group_seed + j`` (`sample_seed`), and its later turns
with a hash of that seed and the turn number (`turn_seed`). Hashing, not spacing seeds by a
stride, is what keeps them apart: with a stride, turn ``t`` of group ``k`` lands on turn 0 of
group ``k + t``. Hashed seeds are 62-bit: two runs of ``group_size`` consecutive seeds overlap
with a probability of about ``group_size / 2**61`` per pair, negligible at any run length.

Pure Python.
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
    """Hash integers (any sign, any size) into a ``SEED_BITS``-bit seed, order-sensitively.

    Args:
        *parts (int): The values to hash, e.g. ``(run_seed, group_id)``.

    Returns:
        int: A seed in ``[0, 2**SEED_BITS)``.
    """
    state = 0
    for part in parts:
        state = _splitmix64(state ^ (int(part) & _MASK64))
    return state >> (64 - SEED_BITS)


def group_seed(run_seed: int, group_id: int) -> int:
    """The seed of a group's first request: a hash of the run seed and its group id.

    Args:
        run_seed (int): The run's ``seed``.
        group_id (int): The group's id (unique across collectors).

    Returns:
        int: The seed; episode ``j``'s first turn samples with ``sample_seed(seed, j, 0)``.
    """
    return mix_seed(run_seed, group_id)


def turn_seed(first_turn_seed: int, turn: int) -> int:
    """The seed of policy turn ``turn`` of an episode whose first turn samples with
    ``first_turn_seed`` (`grpo.envs.Episode.seed`).

    Turn 0 is ``first_turn_seed`` itself; a later turn hashes the turn in, so it repeats no
    seed of this episode, of its group or of any other group.

    Args:
        first_turn_seed (int): The episode's first turn's seed (`sample_seed` of turn 0).
        turn (int): The policy turn, from 0.

    Returns:
        int: The seed, in ``[0, 2**SEED_BITS)``.
    """
    return first_turn_seed if turn == 0 else mix_seed(first_turn_seed, turn)


def choice_seed(seed: int, choice: int) -> int:
    """The seed of answer ``choice`` of a policy turn sampled several times (an agent's call
    with ``n`` above 1, `grpo.envs.AgentEnv`), whose own seed is ``seed``.

    Choice 0 is the turn's own seed. A later choice hashes a negative tag in, a value no turn
    number takes: choice ``i`` of an episode's first turn is then not its turn ``i``
    (`turn_seed` hashes ``(first_turn_seed, i)``), and no choice repeats another turn's seed.

    Args:
        seed (int): The turn's seed (`turn_seed`).
        choice (int): The answer's index, from 0.

    Returns:
        int: The seed, in ``[0, 2**SEED_BITS)``.
    """
    return seed if choice == 0 else mix_seed(seed, -1 - choice)


def sample_seed(group: int, member: int, turn: int) -> int:
    """The seed of policy turn ``turn`` of episode ``member`` of a group.

    Turn 0 is ``group + member``: what vLLM gives sample ``member`` of one request of ``n``
    samples seeded with ``group`` (a single-turn group is such a request). Later turns:
    `turn_seed`.

    Args:
        group (int): The group's seed (`group_seed`).
        member (int): The episode's index in the group, ``[0, group_size)``.
        turn (int): The policy turn, from 0.

    Returns:
        int: The seed, in ``[0, 2**SEED_BITS)``.
    """
    return turn_seed((group + member) % 2**SEED_BITS, turn)
