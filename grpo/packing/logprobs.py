"""Hidden states to response-token logprobs, a chunk of tokens at a time.

Only the hidden rows at a pack's ``logit_positions`` are projected to the vocabulary, a chunk
at a time, and each chunk is recomputed in backward: the pack's ``[L, V]`` logits are never
built, so the projection's memory is ``O(chunk_size * V)``. Logits are divided by the sampling
temperature, as the engine's sampler divides them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn

from grpo.packing.packs import packed_forward_inputs
from grpo.types import PackedTrajectory

DEFAULT_CHUNK_SIZE = 512


class _ChunkedLinearLogprobs(torch.autograd.Function):
    """``log_softmax(hidden @ weight.T / temperature)[t, targets[t]]``, a chunk of rows at once.

    Forward keeps no logits; backward recomputes each chunk's logits and uses
    ``d logprob / d logits = (onehot(target) - softmax(logits / temperature)) / temperature``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_size, temperature):
        # At least fp32 (bf16 logits are upcast); float64 inputs stay float64.
        compute_dtype = torch.promote_types(hidden.dtype, torch.float32)
        logprobs = torch.empty(hidden.shape[0], dtype=compute_dtype, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            logits = _scaled_logits(hidden[start:end], weight, compute_dtype, temperature)
            target_logits = logits.gather(1, targets[start:end, None]).squeeze(1)
            logprobs[start:end] = target_logits - torch.logsumexp(logits, dim=-1)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk_size = chunk_size
        ctx.temperature = temperature
        return logprobs

    @staticmethod
    def backward(ctx, grad_logprobs):
        hidden, weight, targets = ctx.saved_tensors
        needs_hidden_grad, needs_weight_grad = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros_like(hidden) if needs_hidden_grad else None
        grad_weight = torch.zeros_like(weight) if needs_weight_grad else None
        compute_dtype = torch.promote_types(hidden.dtype, torch.float32)
        grad_logprobs = grad_logprobs.to(compute_dtype)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            hidden_chunk = hidden[start:end]
            grad_chunk = grad_logprobs[start:end, None]
            logits = _scaled_logits(hidden_chunk, weight, compute_dtype, ctx.temperature)
            grad_logits = logits.softmax(dim=-1).mul_(-grad_chunk)
            grad_logits.scatter_add_(1, targets[start:end, None], grad_chunk)
            if ctx.temperature != 1.0:  # the chain rule through logits / temperature
                grad_logits.div_(ctx.temperature)
            grad_logits = grad_logits.to(hidden.dtype)
            if needs_hidden_grad:
                grad_hidden[start:end] = grad_logits @ weight
            if needs_weight_grad:
                grad_weight.addmm_(grad_logits.t(), hidden_chunk)
        return grad_hidden, grad_weight, None, None, None


def _scaled_logits(
    hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, temperature: float
) -> torch.Tensor:
    """``hidden @ weight.T`` in ``dtype``, divided by the temperature after upcasting, as vLLM's
    sampler does."""
    logits = (hidden @ weight.t()).to(dtype)
    return logits if temperature == 1.0 else logits.div_(temperature)


def check_temperature(temperature: float) -> float:
    """``temperature`` as a float; ValueError unless it is a finite number > 0."""
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or temperature <= 0
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def check_chunk_size(chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _response_positions(
    length: int, response_mask: torch.Tensor, targets: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """Indices ``t - 1`` of every response token ``t``: where its logprob is read from."""
    if response_mask.dim() != 1 or response_mask.numel() != length:
        raise ValueError(
            f"response_mask must have shape ({length},), got {tuple(response_mask.shape)}"
        )
    if targets.dim() != 1:
        raise ValueError(f"targets must be 1-D, got shape {tuple(targets.shape)}")
    positions = response_mask[1:].bool().nonzero().squeeze(-1).to(device)
    if positions.numel() != targets.numel():
        raise ValueError(
            f"response_mask[1:] selects {positions.numel()} positions but there are "
            f"{targets.numel()} targets (the first token of a pack cannot be a response token)"
        )
    return positions


def _as_packed_row(hidden_states: torch.Tensor, output_weight: torch.Tensor) -> torch.Tensor:
    """``hidden_states`` as ``[L, D]``, checked against the ``[V, D]`` output weight."""
    if hidden_states.dim() == 3:
        if hidden_states.shape[0] != 1:
            raise ValueError(
                f"hidden_states must be one packed row [1, L, D], got {tuple(hidden_states.shape)}"
            )
        hidden_states = hidden_states[0]
    if hidden_states.dim() != 2:
        raise ValueError(
            f"hidden_states must be [L, D] or [1, L, D], got {tuple(hidden_states.shape)}"
        )
    if output_weight.dim() != 2 or output_weight.shape[1] != hidden_states.shape[1]:
        raise ValueError(
            f"output_weight must be [V, {hidden_states.shape[1]}], got {tuple(output_weight.shape)}"
        )
    return hidden_states


def target_logprobs_from_hidden(
    hidden_states: torch.Tensor,
    output_weight: torch.Tensor,
    logit_positions: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Logprob of each target under the hidden row that predicts it, projecting in chunks.

    A row may predict several targets (a shared prompt's last token); its gradient is then the
    sum over them.

    Args:
        hidden_states: Post-norm hidden states of one packed row, ``[L, D]`` or ``[1, L, D]``.
        output_weight: Output projection weight ``[V, D]`` (no bias).
        logit_positions: Row index of each target, ``[T]``.
        targets: Token ids, ``[T]``.

    Returns:
        torch.Tensor: Logprobs ``[T]`` in fp32 (float64 for float64 inputs), differentiable
        w.r.t. ``hidden_states`` and ``output_weight``.

    Raises:
        ValueError: On mismatched shapes, or a temperature that is not a number > 0.
    """
    check_chunk_size(chunk_size)
    temperature = check_temperature(temperature)
    hidden_states = _as_packed_row(hidden_states, output_weight)
    if logit_positions.dim() != 1 or targets.dim() != 1:
        raise ValueError(
            f"logit_positions and targets must be 1-D, got {tuple(logit_positions.shape)} and "
            f"{tuple(targets.shape)}"
        )
    if logit_positions.numel() != targets.numel():
        raise ValueError(f"{logit_positions.numel()} logit_positions for {targets.numel()} targets")
    positions = logit_positions.to(hidden_states.device).long()
    selected = hidden_states.index_select(0, positions).to(output_weight.dtype)
    return _ChunkedLinearLogprobs.apply(
        selected, output_weight, targets.to(selected.device).long(), chunk_size, temperature
    )


def response_logprobs_from_hidden(
    hidden_states: torch.Tensor,
    output_weight: torch.Tensor,
    response_mask: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """Logprobs of the response tokens of a row of contiguous sequences, chunk by chunk.

    For packs without shared prompts: each token is predicted by the row before it.

    Args:
        hidden_states: Post-norm hidden states of one packed row, ``[L, D]`` or ``[1, L, D]``.
        output_weight: Output projection weight ``[V, D]`` (no bias).
        response_mask: Bool ``[L]``, True on response tokens.
        targets: Response token ids in pack order, ``[T]``.

    Returns:
        torch.Tensor: Logprobs ``[T]`` in fp32 (float64 for float64 inputs), differentiable
        w.r.t. ``hidden_states`` and ``output_weight``.

    Raises:
        ValueError: On mismatched shapes, or if ``response_mask`` and ``targets`` disagree.
    """
    check_chunk_size(chunk_size)
    hidden_states = _as_packed_row(hidden_states, output_weight)
    positions = _response_positions(
        hidden_states.shape[0], response_mask, targets, hidden_states.device
    )
    return target_logprobs_from_hidden(hidden_states, output_weight, positions, targets, chunk_size)


def packed_logprobs_from_hidden(
    hidden_states: torch.Tensor,
    output_weight: torch.Tensor,
    packed: PackedTrajectory,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Logprobs of a pack's ``targets``, read at its ``logit_positions`` (any layout).

    Args:
        hidden_states: Post-norm hidden states of the pack, ``[L, D]`` or ``[1, L, D]``.
        output_weight: Output projection weight ``[V, D]`` (no bias).

    Returns:
        torch.Tensor: fp32 logprobs ``[packed.num_response_tokens]`` aligned with
        ``packed.targets``.

    Raises:
        ValueError: If ``hidden_states`` does not have the pack's length.
    """
    rows = hidden_states.shape[-2]
    if rows != packed.packed_seq_len:
        raise ValueError(
            f"hidden_states has {rows} rows but the pack has {packed.packed_seq_len} tokens"
        )
    return target_logprobs_from_hidden(
        hidden_states,
        output_weight,
        packed.logit_positions,
        packed.targets,
        chunk_size,
        temperature,
    )


def output_projection_weight(
    model_or_projection: nn.Module | Callable[..., torch.Tensor],
) -> torch.Tensor:
    """The ``[V, D]`` weight of a torchtune model's output projection.

    Accepts a ``TransformerDecoder``, a bias-free ``nn.Linear`` or a ``TiedLinear``. Under
    FSDP2 read it after the forward, while the root group's parameters are unsharded.

    Raises:
        TypeError: For a projection that is not a bias-free linear map.
    """
    projection = getattr(model_or_projection, "output", model_or_projection)
    # torchtune's TiedLinear is a plain callable holding the embedding module.
    if hasattr(projection, "tied_module"):
        return projection.tied_module.weight
    if isinstance(projection, nn.Linear):
        if projection.bias is not None:
            raise TypeError(
                "output projection has a bias; only bias-free projections are supported"
            )
        return projection.weight
    raise TypeError(
        f"unsupported output projection {type(projection).__name__}; expected nn.Linear "
        "(bias=False) or torchtune TiedLinear"
    )


@contextlib.contextmanager
def _skip_output_projection(model: nn.Module) -> Iterator[None]:
    """Make a torchtune ``TransformerDecoder`` return its final-norm output, not logits."""
    if hasattr(model, "skip_output_layer"):  # torchtune versions that support it natively
        previous = model.skip_output_layer
        model.skip_output_layer = True
        try:
            yield
        finally:
            model.skip_output_layer = previous
        return
    # torchtune 0.6.1 ends forward with `self.unembed(h)`; an instance attribute shadows it.
    # A lambda, not the norm module, so nn.Module does not register a submodule.
    previous = model.__dict__.get("unembed")  # an override set by someone else stays
    model.unembed = lambda hidden: model.norm(hidden)
    try:
        yield
    finally:
        if previous is None:
            del model.unembed
        else:
            model.unembed = previous


def model_hidden_states(model: nn.Module, packed: PackedTrajectory) -> torch.Tensor:
    """The ``[L, D]`` post-norm hidden states of a torchtune ``TransformerDecoder`` on a pack."""
    with _skip_output_projection(model):
        hidden = model(**packed_forward_inputs(packed))
    if isinstance(hidden, list):  # output_hidden_states set: the final output is last
        hidden = hidden[-1]
    return hidden[0]


def model_response_logprobs(
    model: nn.Module,
    packed: PackedTrajectory,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Response logprobs of a pack under a torchtune model, through the chunked projection.

    Args:
        temperature: ``inference.temperature``, so the logprobs match the engine's.

    Returns:
        torch.Tensor: fp32 logprobs ``[packed.num_response_tokens]`` aligned with
        ``packed.targets``; differentiable unless called under ``torch.no_grad()``.
    """
    hidden = model_hidden_states(model, packed)
    return packed_logprobs_from_hidden(
        hidden, output_projection_weight(model), packed, chunk_size, temperature
    )
