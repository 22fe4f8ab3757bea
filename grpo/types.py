"""Data passed between the actors of the pipeline.

Constructors check shapes and lengths, so a malformed trajectory fails where it is made, not
three actors later inside a forward pass.
"""

from __future__ import annotations

import dataclasses
import math
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
    """True entries of the flat ``mask`` within each sequence, whose lengths are ``lens``."""
    index = torch.arange(lens.numel(), device=mask.device).repeat_interleave(
        lens, output_size=mask.numel()
    )
    return torch.zeros_like(lens).index_add_(0, index, mask.long())


# Where a pickled trajectory keeps its tensors until one of them is read (`_PackedTensors`).
_PACKED = "_packed_tensors"
# Offsets of the tensors in a pack: float64 and int64 views need 8-byte alignment.
_ALIGN = 8


@dataclass(frozen=True)
class _PackedTensors:
    """CPU tensors in one writable buffer: per tensor ``(name, dtype, shape, offset)``."""

    specs: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]
    data: bytearray

    @classmethod
    def pack(cls, tensors: dict[str, torch.Tensor]) -> _PackedTensors:
        specs, offset = [], 0
        for name, tensor in tensors.items():
            specs.append((name, tensor.dtype, tuple(tensor.shape), offset))
            offset += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
        data = bytearray(offset)
        buffer = memoryview(data)
        for (_, dtype, _, start), tensor in zip(specs, tensors.values()):
            # A memoryview copy, not torch ops: half the time for a trajectory's few small
            # tensors. numpy has no bfloat16, so its bits go as int16.
            tensor = tensor if tensor.is_contiguous() else tensor.contiguous()
            array = tensor.view(torch.int16) if dtype == torch.bfloat16 else tensor
            raw = memoryview(array.numpy()).cast("B")
            buffer[start : start + raw.nbytes] = raw
        return cls(tuple(specs), data)

    def names(self) -> set[str]:
        return {name for name, _, _, _ in self.specs}

    def unpack(self) -> dict[str, torch.Tensor]:
        """The tensors, as views of the buffer (no copy)."""
        tensors = {}
        for name, dtype, shape, offset in self.specs:
            numel = math.prod(shape)  # not np.prod: a few µs a call, the tensor's own cost
            tensors[name] = (
                torch.frombuffer(self.data, dtype=dtype, count=numel, offset=offset).view(shape)
                if numel
                else torch.empty(shape, dtype=dtype)
            )
        return tensors


class _PacksTensorsWhenPickled:
    """Pickles its CPU tensor attributes as one buffer, unpacked when one of them is first read.

    Through Ray this is much faster than torch's storage protocol (docs/benchmarks.md), and an
    actor that only passes trajectories on (the rollout queue, the replay buffer) reads their
    ids and versions without ever unpacking their tensors, and passes the buffer on as it came.
    Tensors on a GPU or requiring grad pickle as torch pickles them.
    """

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if _PACKED in state:  # never unpacked here: passed on as it came
            return state
        tensors = {
            name: value
            for name, value in state.items()
            if isinstance(value, torch.Tensor)
            and value.device.type == "cpu"
            and not value.requires_grad
        }
        for name in tensors:
            del state[name]
        if tensors:
            state[_PACKED] = _PackedTensors.pack(tensors)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # numpy arrays: pickled by an earlier version (a checkpoint's unscored groups).
        self.__dict__.update(
            {
                name: _as_tensor(value) if isinstance(value, np.ndarray) else value
                for name, value in state.items()
            }
        )
        packed = self.__dict__.get(_PACKED)
        if packed is not None and any(hasattr(type(self), name) for name in packed.names()):
            # A class attribute of that name would hide a packed tensor from `__getattr__`
            # (see `_tensor_defaults_off_the_class`): unpack now.
            self._unpack()

    def _unpack(self) -> None:
        packed = self.__dict__.get(_PACKED)
        if packed is None:
            return
        for name, tensor in packed.unpack().items():
            self.__dict__.setdefault(name, tensor)  # a field set since keeps its new value
        # Dropped only once the tensors are in place, for a reader on another thread.
        self.__dict__.pop(_PACKED, None)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not set: a packed tensor, read for the first time.
        packed = self.__dict__.get(_PACKED)
        if packed is not None and name in packed.names():
            self._unpack()
        try:
            return self.__dict__[name]
        except KeyError:
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}"
            ) from None


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def _tensor_defaults_off_the_class(cls: type) -> type:
    """Class decorator, over ``@dataclass``: drop the class attributes that hold the defaults
    of tensor fields (``response_mask = None``), which ``__init__`` does not use, so that a
    packed tensor of that name reaches `_PacksTensorsWhenPickled.__getattr__` instead of
    reading as the default."""
    for spec in dataclasses.fields(cls):
        if "Tensor" in str(spec.type) and spec.name in vars(cls):
            delattr(cls, spec.name)
    return cls


@_tensor_defaults_off_the_class
@dataclass
class UnscoredTrajectory(_PacksTensorsWhenPickled):
    """One generated sequence: an unpadded prompt, its response and the sampler's logprobs.

    Args:
        prompt_tokens: Unpadded prompt token ids, shape ``(prompt_len,)``.
        response_tokens: Unpadded response token ids, shape ``(response_len,)``.
        prompt_len: Number of prompt tokens (at least 1).
        response_len: Number of response tokens.
        logprobs: Behaviour (vLLM) logprobs of the response tokens, ``(response_len,)``.
        policy_version: Training steps taken by the weights that generated its oldest token.
        response_mask: Bool ``(response_len,)``: False on a multi-turn episode's environment
            tokens (never trained; their ``logprobs`` are 0). None: all are the policy's.
        env_rewards: Rewards the environment gave the episode, by name.
        env_successes: The reward functions' success flags, by name; None: a reward above 0
            counts as a success.
        last_policy_version: Version of the weights that generated its newest token (newer
            after an in-flight update); None: ``policy_version``.

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

    ``total_tokens`` is the sum of ``prompt_len + response_len`` over the group.

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
class GroupRecord:
    """What it takes to generate a group again after the actor holding it died.

    Args:
        group_id: The group's id (its sampling seeds follow from it).
        prompt: ``(example, prompt token ids)`` as the collector's stream gave it.
        sequence_ids: Its trajectories' ids, in order; a regenerated group reuses them.
        policy_version: Version of its oldest policy token (staleness is counted from it).
        exclude: Sequence ids trained on already, which the regenerated group leaves out.
    """

    group_id: int
    prompt: tuple[dict[str, Any], list[int]]
    sequence_ids: list[str]
    policy_version: int
    exclude: set[str] = field(default_factory=set)


@_tensor_defaults_off_the_class
@dataclass
class ScoredTrajectory(_PacksTensorsWhenPickled):
    """A trajectory with reference logprobs, rewards and its group-relative advantage.

    The fields shared with `UnscoredTrajectory` mean the same.

    Args:
        ref_logprobs: Reference-model logprobs, ``(response_len,)``; None without a reference
            model.
        rewards: One reward per reward function, ``(num_funcs,)``.
        advantages: A scalar shared by every response token (GRPO), or one per response token
            (on-policy distillation).
        successes: One success flag per reward function, ``(num_funcs,)``.
        reward_metadata: At least ``func_names``, one per reward function.

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
        """The advantage of each response token, float32 ``(response_len,)``."""
        if self.advantages.dim() == 1:
            return self.advantages
        return self.advantages.expand(self.response_len)


@dataclass
class PackedTrajectory:
    """Many sequences concatenated into one row ``[P1 R1 P2 R2 ... Pn Rn PAD...]``.

    Built by `grpo.packing.packs.pack_sequences`. ``targets`` holds the response tokens in the
    order of ``sequence_ids``, and ``hidden[logit_positions]`` lines up with it one to one.

    Args:
        attention_mask: Dense bool ``(L, L)`` (True = may attend), a ``BlockMask`` or a
            `VarlenMask`.
        position_ids: Shape ``(packed_seq_len,)``, restarting at 0 per sequence.
        response_mask: Bool, True on response tokens, ``(packed_seq_len,)``.
        sequence_mask: Index of each token's sequence (a shared prompt: the first sharing it),
            -1 on padding.
        sequence_map: ``[start, end)`` of each sequence's own tokens, ``(num_sequences, 2)``.
        targets: Response tokens in sequence order, ``(total_response_tokens,)``.
        ref_logprobs: Reference logprobs, aligned with ``targets``.
        advantages: Per-token advantages, aligned with ``targets``.
        behavior_logprobs: vLLM logprobs, aligned with ``targets``.
        logit_positions: Hidden row predicting each target; None: ``response_mask[1:]``'s
            positions (every sequence one contiguous block).
        shared_prompt_tokens: Prompt tokens not repeated thanks to shared prompts.
        loss_mask: Bool, aligned with ``targets``: False on environment tokens, which the
            loss skips. None: every target is trained.

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
        ratios: Token mean of the clipped objective's ratio.
        clipfrac: Fraction of response tokens whose ratio was clipped.
        approx_policy_kls: Token mean of ``0.5 * (pi - behaviour)^2``.
        metadata: Counts and debug data (`grpo.objective.loss.combine_stats` reads them).
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl_loss: torch.Tensor
    ratios: torch.Tensor
    clipfrac: torch.Tensor
    approx_policy_kls: torch.Tensor
    metadata: dict[str, Any] | None = None
