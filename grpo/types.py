"""Data passed between the actors of the pipeline.

One instance is one sequence, except `GroupedUnscoredTrajectories` (all samples of one prompt)
and `PackedTrajectory` (many sequences concatenated into one block-causal row). Constructors
check shapes and lengths so that a malformed trajectory fails where it is made, not three
actors later inside a forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def _check_1d(name: str, tensor: torch.Tensor, length: int, owner: str) -> None:
    """Raise a ValueError unless `tensor` is 1-D with `length` elements."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{owner}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 1 or tensor.numel() != length:
        raise ValueError(f"{owner}: {name} must have shape ({length},), got {tuple(tensor.shape)}")


def _check_response_mask(mask: torch.Tensor | None, length: int, owner: str) -> None:
    """Raise a ValueError unless ``mask`` is None or a 1-D bool tensor of ``length`` elements."""
    if mask is None:
        return
    _check_1d("response_mask", mask, length, owner)
    if mask.dtype != torch.bool:
        raise ValueError(f"{owner}: response_mask must be a bool tensor, got {mask.dtype}")


def _policy_len(response_len: int, mask: torch.Tensor | None) -> int:
    return response_len if mask is None else int(mask.sum())


def count_per_sequence(mask: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """True entries of the flat ``mask`` within each sequence, whose lengths are ``lens``.

    Example:
        >>> count_per_sequence(torch.tensor([1, 0, 1, 1], dtype=torch.bool), torch.tensor([3, 1]))
        tensor([2, 1])
    """
    index = torch.arange(lens.numel(), device=mask.device).repeat_interleave(
        lens, output_size=mask.numel()
    )
    return torch.zeros_like(lens).index_add_(0, index, mask.long())


class _PicklesTensorsAsArrays:
    """Pickles tensor attributes as numpy arrays: 6-10x faster through Ray for small tensors.

    Trajectories cross Ray several times a step (collector, reference actor, replay buffer,
    trainer), and torch pickles each tensor through its own storage protocol, about 0.3 ms
    apiece; a batch of 64 trajectories took 30-45 ms per ``ray.put`` or ``ray.get``. A numpy
    array pickles as its bytes. The tensors come back as tensors (copies when the array's
    buffer is read-only, as Ray's zero-copy reads are), so nothing else changes.
    """

    def __getstate__(self) -> dict[str, Any]:
        return {
            name: _as_array(value) if isinstance(value, torch.Tensor) else value
            for name, value in self.__dict__.items()
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(
            {
                name: _as_tensor(value) if isinstance(value, np.ndarray) else value
                for name, value in state.items()
            }
        )


def _as_array(tensor: torch.Tensor) -> np.ndarray | torch.Tensor:
    # numpy has no bfloat16; such a tensor (and any not on the CPU) pickles as torch does.
    if tensor.device.type != "cpu" or tensor.dtype == torch.bfloat16 or tensor.requires_grad:
        return tensor
    return tensor.numpy()


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array if array.flags.writeable else array.copy())


@dataclass
class UnscoredTrajectory(_PicklesTensorsAsArrays):
    """One generated sequence: an unpadded prompt, its response and the sampler's logprobs.

    Args:
        prompt_tokens (torch.Tensor): Unpadded prompt token ids, shape ``(prompt_len,)``.
        response_tokens (torch.Tensor): Unpadded response token ids, shape ``(response_len,)``.
        prompt_len (int): Number of prompt tokens (at least 1).
        response_len (int): Number of response tokens.
        logprobs (torch.Tensor): Behaviour (vLLM) logprobs of the response tokens,
            shape ``(response_len,)``.
        answer (str): Ground-truth answer of the prompt.
        sequence_id (str): Unique id of this sequence.
        policy_version (int): Version of the weights that generated its oldest token: the
            training steps those weights had taken (the replay buffer's ``max_policy_lag``
            counts from it).
        group_id (int): Id of the prompt group it belongs to.
        response_mask (torch.Tensor | None): Bool ``(response_len,)``: True on the tokens the
            policy sampled (trained), False on the environment's tokens of a multi-turn
            episode (tool results, user replies: in the sequence, never trained; their
            ``logprobs`` entries are 0). None: every response token is the policy's.
        env_rewards (dict[str, float] | None): Rewards the environment gave the episode, by
            name (`grpo.envs.protocol.Environment.score`); the reference actor turns them
            into advantages.
        env_successes (dict[str, float] | None): The reward functions' success flags, by
            name; None: a reward above 0 counts as a success.
        episode_stats (dict[str, float] | None): Counts of a multi-turn episode (turns, tool
            calls, tool errors, environment tokens, truncation), for metrics.
        last_policy_version (int | None): Version of the weights that generated its newest
            token, newer than ``policy_version`` when weights changed while it was sampled
            (an in-flight update); None: the same as ``policy_version``.

    Raises:
        ValueError: If a length does not match its tensor.
    """

    prompt_tokens: torch.Tensor
    response_tokens: torch.Tensor
    prompt_len: int
    response_len: int
    logprobs: torch.Tensor
    answer: str
    sequence_id: str
    policy_version: int
    group_id: int
    response_mask: torch.Tensor | None = None
    env_rewards: dict[str, float] | None = None
    episode_stats: dict[str, float] | None = None
    last_policy_version: int | None = None
    env_successes: dict[str, float] | None = None

    def __post_init__(self) -> None:
        owner = f"{type(self).__name__}(sequence_id={self.sequence_id!r})"
        if self.prompt_len < 1:
            raise ValueError(f"{owner}: prompt_len must be >= 1, got {self.prompt_len}")
        if self.response_len < 0:
            raise ValueError(f"{owner}: response_len must be >= 0, got {self.response_len}")
        _check_1d("prompt_tokens", self.prompt_tokens, self.prompt_len, owner)
        _check_1d("response_tokens", self.response_tokens, self.response_len, owner)
        _check_1d("logprobs", self.logprobs, self.response_len, owner)
        _check_response_mask(self.response_mask, self.response_len, owner)

    @property
    def total_len(self) -> int:
        """Prompt plus response length."""
        return self.prompt_len + self.response_len

    @property
    def policy_len(self) -> int:
        """Response tokens the policy sampled: the ones the loss trains."""
        return _policy_len(self.response_len, self.response_mask)


@dataclass
class GroupedUnscoredTrajectories:
    """All samples generated for one prompt; the unit the reference actor scores.

    Args:
        trajectories (list[UnscoredTrajectory]): The group's samples.
        group_id (int): Id shared by every trajectory in the group.
        total_tokens (int): Sum of ``prompt_len + response_len`` over the group.

    Raises:
        ValueError: If the group is empty, ids disagree or ``total_tokens`` is wrong.
    """

    trajectories: list[UnscoredTrajectory]
    group_id: int
    total_tokens: int

    def __post_init__(self) -> None:
        owner = f"GroupedUnscoredTrajectories(group_id={self.group_id})"
        if not self.trajectories:
            raise ValueError(f"{owner}: trajectories is empty")
        for traj in self.trajectories:
            if traj.group_id != self.group_id:
                raise ValueError(
                    f"{owner}: trajectory {traj.sequence_id!r} has group_id {traj.group_id}"
                )
        expected = sum(t.total_len for t in self.trajectories)
        if self.total_tokens != expected:
            raise ValueError(f"{owner}: total_tokens is {self.total_tokens}, expected {expected}")

    @classmethod
    def from_trajectories(
        cls, trajectories: list[UnscoredTrajectory]
    ) -> GroupedUnscoredTrajectories:
        """Build a group, deriving ``group_id`` and ``total_tokens`` from its members."""
        if not trajectories:
            raise ValueError("GroupedUnscoredTrajectories: trajectories is empty")
        return cls(
            trajectories=list(trajectories),
            group_id=trajectories[0].group_id,
            total_tokens=sum(t.total_len for t in trajectories),
        )


@dataclass
class ScoredTrajectory(_PicklesTensorsAsArrays):
    """A trajectory with reference logprobs, rewards and its group-relative advantage.

    Args:
        prompt_tokens (torch.Tensor): Shape ``(prompt_len,)``.
        response_tokens (torch.Tensor): Shape ``(response_len,)``.
        prompt_len (int): Number of prompt tokens.
        response_len (int): Number of response tokens.
        logprobs (torch.Tensor): Behaviour (vLLM) logprobs, shape ``(response_len,)``.
        ref_logprobs (torch.Tensor | None): Reference-model logprobs, shape
            ``(response_len,)``; None when the run has no reference model (``kl_coeff`` 0).
        rewards (torch.Tensor): One reward per reward function, shape ``(num_funcs,)``.
        advantages (torch.Tensor): The advantage: a scalar shared by every response token
            (GRPO), or one per response token, shape ``(response_len,)`` (on-policy
            distillation adds a per-token teacher signal:
            `grpo.objective.advantages.distillation_advantages`).
        successes (torch.Tensor): One success flag per reward function, shape ``(num_funcs,)``.
        answer (str): Ground-truth answer.
        sequence_id (str): Unique id of this sequence.
        group_id (int): Prompt group id.
        reward_metadata (dict): At least ``func_names``, one per reward function.
        policy_version (int): Version of the weights that generated its oldest token.
        response_mask (torch.Tensor | None): Bool ``(response_len,)``, True on policy tokens
            (see `UnscoredTrajectory`); None: all of them.
        episode_stats (dict[str, float] | None): See `UnscoredTrajectory`.
        last_policy_version (int | None): See `UnscoredTrajectory`.

    Raises:
        ValueError: If a shape does not match.
    """

    prompt_tokens: torch.Tensor
    response_tokens: torch.Tensor
    prompt_len: int
    response_len: int
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None
    rewards: torch.Tensor
    advantages: torch.Tensor
    successes: torch.Tensor
    answer: str
    sequence_id: str
    group_id: int
    reward_metadata: dict[str, Any]
    policy_version: int
    response_mask: torch.Tensor | None = None
    episode_stats: dict[str, float] | None = None
    last_policy_version: int | None = None

    def __post_init__(self) -> None:
        owner = f"ScoredTrajectory(sequence_id={self.sequence_id!r})"
        if self.prompt_len < 1:
            raise ValueError(f"{owner}: prompt_len must be >= 1, got {self.prompt_len}")
        if self.response_len < 0:
            raise ValueError(f"{owner}: response_len must be >= 0, got {self.response_len}")
        _check_1d("prompt_tokens", self.prompt_tokens, self.prompt_len, owner)
        _check_1d("response_tokens", self.response_tokens, self.response_len, owner)
        _check_1d("logprobs", self.logprobs, self.response_len, owner)
        if self.ref_logprobs is not None:
            _check_1d("ref_logprobs", self.ref_logprobs, self.response_len, owner)
        _check_response_mask(self.response_mask, self.response_len, owner)
        self.advantages = torch.as_tensor(self.advantages, dtype=torch.float32)
        per_token = self.advantages.dim() == 1 and self.advantages.numel() == self.response_len
        if not per_token and self.advantages.numel() == 1:
            self.advantages = self.advantages.reshape(())
        elif not per_token:
            raise ValueError(
                f"{owner}: advantages must be a scalar or have shape ({self.response_len},), "
                f"got {tuple(self.advantages.shape)}"
            )
        if self.rewards.dim() != 1 or self.successes.shape != self.rewards.shape:
            raise ValueError(
                f"{owner}: rewards and successes must both have shape (num_funcs,), got "
                f"{tuple(self.rewards.shape)} and {tuple(self.successes.shape)}"
            )
        names = self.reward_metadata.get("func_names") if self.reward_metadata else None
        if names is not None and len(names) != self.rewards.numel():
            raise ValueError(f"{owner}: {len(names)} func_names but {self.rewards.numel()} rewards")

    @property
    def total_len(self) -> int:
        """Prompt plus response length."""
        return self.prompt_len + self.response_len

    @property
    def policy_len(self) -> int:
        """Response tokens the policy sampled: the ones the loss trains."""
        return _policy_len(self.response_len, self.response_mask)

    @property
    def token_advantages(self) -> torch.Tensor:
        """The advantage of each response token, float32 ``(response_len,)``: ``advantages``
        itself when it is per token, else the scalar repeated."""
        if self.advantages.dim() == 1:
            return self.advantages
        return self.advantages.expand(self.response_len)


@dataclass
class PackedTrajectory:
    """Many sequences concatenated into one row ``[P1 R1 P2 R2 ... Pn Rn PAD...]``.

    The model sees ``tokens[None]`` with ``attention_mask`` (block-causal: a token attends only
    to earlier tokens of its own sequence) and ``position_ids`` that restart at 0 per sequence.
    Padding, if any, is one extra block at the tail with ``sequence_mask == -1``.

    With shared prompts (`grpo.packing.packs.pack_sequences` with ``share_prompts``), sequences of
    one group with the same prompt are laid out as ``[P R1 R2 ... RG]``: the prompt once, each
    response after it with position ids continuing from ``prompt_len`` and attending to the
    whole prompt and to its own earlier tokens only.

    The logprob of a response token is read from the hidden state at ``logit_positions``: the
    token before it in its sequence (for the first response token, the prompt's last token,
    one row shared by every response of that prompt). ``targets`` holds the response tokens,
    sequence after sequence in the order of ``sequence_ids``, so ``hidden[logit_positions]``
    lines up with ``targets`` one to one.

    Args:
        tokens (torch.Tensor): Shape ``(packed_seq_len,)``.
        attention_mask (torch.Tensor | BlockMask | VarlenMask): Dense bool ``(L, L)`` (True =
            may attend), a FlexAttention ``BlockMask`` or a `grpo.packing.attention.VarlenMask`.
        position_ids (torch.Tensor): Shape ``(packed_seq_len,)``, restarting at 0 per sequence.
        response_mask (torch.Tensor): Bool, True on response tokens, shape ``(packed_seq_len,)``.
        sequence_mask (torch.Tensor): Index of the sequence each token belongs to (a shared
            prompt: the first sequence sharing it), -1 on padding, shape ``(packed_seq_len,)``.
        prompt_lens (torch.Tensor): Shape ``(num_sequences,)``.
        response_lens (torch.Tensor): Shape ``(num_sequences,)``.
        sequence_map (torch.Tensor): ``[start, end)`` of each sequence's own tokens,
            ``(num_sequences, 2)``: its whole block, or its response when it shares its prompt.
        packed_seq_len (int): Length of ``tokens`` including padding.
        targets (torch.Tensor): Response tokens in sequence order, ``(total_response_tokens,)``.
        ref_logprobs (torch.Tensor | None): Reference logprobs, ``(total_response_tokens,)``.
        advantages (torch.Tensor | None): Per-token advantages, ``(total_response_tokens,)``.
        behavior_logprobs (torch.Tensor | None): vLLM logprobs, ``(total_response_tokens,)``.
        sequence_ids (list[str]): Ids of the packed sequences, in order.
        group_ids (list[int]): Group ids of the packed sequences, in order.
        actual_total_tokens (int): Real (non-padding) tokens.
        logit_positions (torch.Tensor | None): Row of the hidden states that predicts each
            target, ``(total_response_tokens,)``. None: ``response_mask[1:].nonzero()``, the
            layout without shared prompts, where every sequence is one contiguous block.
        shared_prompt_tokens (int): Prompt tokens the pack does not repeat thanks to shared
            prompts (its sequences' total length minus ``actual_total_tokens``).
        loss_mask (torch.Tensor | None): Bool ``(total_response_tokens,)`` aligned with
            ``targets``: the sequences' ``response_mask`` concatenated (True = policy token,
            trained; False = an environment token, which the loss skips). None: every target
            is trained.

    Raises:
        ValueError: If a shape does not match, or ``logit_positions`` is None and
            ``response_mask[1:]`` does not select one position per target.
    """

    tokens: torch.Tensor
    attention_mask: Any
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    sequence_mask: torch.Tensor
    prompt_lens: torch.Tensor
    response_lens: torch.Tensor
    sequence_map: torch.Tensor
    packed_seq_len: int
    targets: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    behavior_logprobs: torch.Tensor | None = None
    sequence_ids: list[str] = field(default_factory=list)
    group_ids: list[int] = field(default_factory=list)
    actual_total_tokens: int = 0
    logit_positions: torch.Tensor | None = None
    shared_prompt_tokens: int = 0
    loss_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        owner = "PackedTrajectory"
        length = self.packed_seq_len
        for name in ("tokens", "position_ids", "response_mask", "sequence_mask"):
            _check_1d(name, getattr(self, name), length, owner)
        num_sequences = self.prompt_lens.numel()
        _check_1d("response_lens", self.response_lens, num_sequences, owner)
        if tuple(self.sequence_map.shape) != (num_sequences, 2):
            raise ValueError(
                f"{owner}: sequence_map must have shape ({num_sequences}, 2), "
                f"got {tuple(self.sequence_map.shape)}"
            )
        num_response_tokens = int(self.response_lens.sum())
        _check_1d("targets", self.targets, num_response_tokens, owner)
        for name in ("ref_logprobs", "advantages", "behavior_logprobs", "loss_mask"):
            value = getattr(self, name)
            if value is not None:
                _check_1d(name, value, num_response_tokens, owner)
        if self.sequence_ids and len(self.sequence_ids) != num_sequences:
            raise ValueError(
                f"{owner}: {len(self.sequence_ids)} sequence_ids for {num_sequences} sequences"
            )
        if self.logit_positions is None:
            # Contiguous sequences: the hidden state at t - 1 predicts the token at t.
            positions = self.response_mask[1:].bool().nonzero().squeeze(-1)
            if positions.numel() != num_response_tokens:
                raise ValueError(
                    f"{owner}: response_mask[1:] selects {positions.numel()} positions but "
                    f"there are {num_response_tokens} targets (the first token of a pack "
                    "cannot be a response token)"
                )
            self.logit_positions = positions
        _check_1d("logit_positions", self.logit_positions, num_response_tokens, owner)

    @property
    def num_sequences(self) -> int:
        """Number of real sequences in the pack."""
        return self.prompt_lens.numel()

    @property
    def num_response_tokens(self) -> int:
        """Number of response tokens (policy and environment)."""
        return self.targets.numel()

    @property
    def policy_lens(self) -> torch.Tensor:
        """Trained (policy) tokens of each sequence, ``(num_sequences,)``."""
        if self.loss_mask is None:
            return self.response_lens
        return count_per_sequence(self.loss_mask, self.response_lens)

    @property
    def padding_tokens(self) -> int:
        """Tail padding tokens."""
        return self.packed_seq_len - self.actual_total_tokens


@dataclass
class GRPOStats:
    """Scalars describing one GRPO loss computation.

    Args:
        loss (torch.Tensor): Total loss (policy + kl).
        policy_loss (torch.Tensor): Clipped surrogate part.
        kl_loss (torch.Tensor): ``kl_coeff`` times the KL estimate.
        ratios (torch.Tensor): Mean over response tokens of the clipped objective's ratio:
            ``exp(pi - behaviour)`` by default (see `grpo.objective.loss.GRPOLoss` for
            the TIS and sequence-level variants).
        clipfrac (torch.Tensor): Fraction of response tokens whose ratio was clipped.
        approx_policy_kls (torch.Tensor): Mean of ``0.5 * (pi - behaviour)^2``.
        metadata (dict | None): Optional debug data, e.g. ``pi_logprobs``.
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl_loss: torch.Tensor
    ratios: torch.Tensor
    clipfrac: torch.Tensor
    approx_policy_kls: torch.Tensor
    metadata: dict[str, Any] | None = None
