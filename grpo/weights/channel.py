"""A two-rank process group that carries weights from trainer rank 0 to one collector.

Each pair has its own group on its own ``TCPStore``, never the default group the trainers use
for FSDP, so a dead peer tears down only its own pair. Both ends derive the same bucket layout
from the `TensorSpec` list; every step has a timeout after which the channel is unusable.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Offsets inside a bucket are multiples of this, so a uint8 slice can be viewed as any dtype.
ALIGN_BYTES = 64
SENDER_RANK = 0
RECEIVER_RANK = 1


class WeightChannelError(RuntimeError):
    """A weight channel's rendezvous or broadcast failed or timed out."""


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver needs to rebuild one tensor; ``dtype`` as in ``"float32"``."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize


def tensor_specs(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """The specs of ``tensors``, in their order (the order both ends pack them in)."""
    return [
        TensorSpec(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
        for name, tensor in tensors.items()
    ]


@dataclass(frozen=True)
class Bucket:
    """One broadcast: ``nbytes`` bytes holding ``entries`` as ``(spec, offset)`` pairs."""

    entries: tuple[tuple[TensorSpec, int], ...]
    nbytes: int


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Group ``specs`` into buckets of at most ``bucket_bytes`` (a bigger tensor gets its own).

    Args:
        specs: Tensors in packing order.
        bucket_bytes: Target bucket size.

    Returns:
        list[Bucket]: The buckets, in broadcast order; the same on both ends.
    """
    buckets: list[Bucket] = []
    entries: list[tuple[TensorSpec, int]] = []
    size = 0
    for spec in specs:
        offset = -(-size // ALIGN_BYTES) * ALIGN_BYTES
        if entries and offset + spec.nbytes > bucket_bytes:
            buckets.append(Bucket(tuple(entries), size))
            entries, offset = [], 0
        entries.append((spec, offset))
        size = offset + spec.nbytes
    if entries:
        buckets.append(Bucket(tuple(entries), size))
    return buckets


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


class WeightChannel:
    """One end of a weight channel: rank 0 (trainer, sends) or rank 1 (collector, receives).

    Construction starts the rendezvous. Rank 0 hosts the store and builds its group in a
    background thread, so it can hand its address (`port`) to the peer before the peer joins;
    rank 1 builds its group in the constructor.

    Args:
        name: The collector this channel reaches; errors name it.
        port: The sender's store port (the sender: 0 for any free one).
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL): where the buckets live.
        timeout_s: Limit of the rendezvous and of every broadcast.

    Raises:
        WeightChannelError: On the receiver, if the rendezvous fails or times out.
    """

    def __init__(
        self,
        name: str,
        rank: int,
        host: str,
        port: int,
        device: str = "cpu",
        *,
        timeout_s: float,
    ) -> None:
        self.name = name
        self.rank = rank
        self.device = torch.device(device)
        self.timeout = timedelta(seconds=timeout_s)
        self._group: dist.ProcessGroup | None = None
        self._error: BaseException | None = None
        self._staging: torch.Tensor | None = None  # the sender's packing buffer
        try:
            self._store = dist.TCPStore(
                host,
                port,
                world_size=2,
                is_master=rank == SENDER_RANK,
                timeout=self.timeout,
                wait_for_workers=False,
            )
        except Exception as error:  # noqa: BLE001 - re-raised with the channel's name
            raise WeightChannelError(
                f"weight channel to {name}: cannot reach the trainer's store at {host}:{port}: "
                f"{error}"
            ) from error
        self.host, self.port = host, self._store.port
        if rank == SENDER_RANK:
            self._ready = threading.Thread(target=self._connect, daemon=True)
            self._ready.start()
        else:
            self._ready = None
            self._connect()
            if self._error is not None:
                raise self._failure("joining", self._error)

    def _connect(self) -> None:
        try:
            if self.device.type == "cuda":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self.timeout
                self._group = dist.ProcessGroupNCCL(self._store, self.rank, 2, options)
            else:
                self._group = dist.ProcessGroupGloo(self._store, self.rank, 2, self.timeout)
        except BaseException as error:  # noqa: BLE001 - reported by the next call
            self._error = error

    def _failure(self, what: str, error: BaseException) -> WeightChannelError:
        peer = "the trainer" if self.rank == RECEIVER_RANK else self.name
        return WeightChannelError(
            f"weight channel to {self.name}: {what} failed or timed out after "
            f"{self.timeout.total_seconds():g} s (is {peer} alive?): {error}"
        )

    def _wait_ready(self) -> dist.ProcessGroup:
        if self._ready is not None:
            self._ready.join(self.timeout.total_seconds() + 5.0)
            if self._ready.is_alive():
                self._error = TimeoutError("the peer did not join")
        if self._group is None:
            raise self._failure("the rendezvous", self._error or RuntimeError("channel closed"))
        return self._group

    def _broadcast(self, group: dist.ProcessGroup, buffer: torch.Tensor, index: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = SENDER_RANK
        options.timeout = self.timeout
        try:
            group.broadcast([buffer], options).wait(self.timeout)
        except Exception as error:  # noqa: BLE001 - re-raised with the channel's name
            self.close()
            raise self._failure(f"broadcast of bucket {index}", error) from error

    def send(self, tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> None:
        """Broadcast ``tensors`` (in their order) to the receiver, bucket by bucket.

        Args:
            tensors: What `tensor_specs` described to the receiver.
            bucket_bytes: The bucket size the receiver was given.

        Raises:
            WeightChannelError: The rendezvous or a broadcast failed or timed out; the channel
                is closed.
        """
        group = self._wait_ready()
        buckets = plan_buckets(tensor_specs(tensors), bucket_bytes)
        for index, bucket in enumerate(buckets):
            first = tensors[bucket.entries[0][0].name]
            if len(bucket.entries) == 1 and first.device == self.device:
                buffer = _as_bytes(first)  # a lone tensor goes as it is, uncopied
            else:
                # Kept across sends: page-faulting a fresh bucket costs as much as the copy.
                if self._staging is None or self._staging.numel() < bucket.nbytes:
                    needed = max(bucket.nbytes for bucket in buckets)
                    self._staging = torch.empty(needed, dtype=torch.uint8, device=self.device)
                buffer = self._staging[: bucket.nbytes]
                for spec, offset in bucket.entries:
                    buffer[offset : offset + spec.nbytes].copy_(_as_bytes(tensors[spec.name]))
            self._broadcast(group, buffer, index)

    def receive(self, specs: Sequence[TensorSpec], bucket_bytes: int) -> dict[str, torch.Tensor]:
        """Receive what the sender's `send` broadcasts.

        Args:
            specs: The sender's `tensor_specs`, in order.
            bucket_bytes: The sender's bucket size.

        Returns:
            dict[str, torch.Tensor]: Name to tensor; each a view into its received bucket.

        Raises:
            WeightChannelError: A broadcast failed or timed out; the channel is closed.
        """
        group = self._wait_ready()
        tensors: dict[str, torch.Tensor] = {}
        for index, bucket in enumerate(plan_buckets(specs, bucket_bytes)):
            buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=self.device)
            self._broadcast(group, buffer, index)
            for spec, offset in bucket.entries:
                flat = buffer[offset : offset + spec.nbytes].view(spec.torch_dtype)
                tensors[spec.name] = flat.view(spec.shape)
        return tensors

    def close(self) -> None:
        """Drop the group and the store (idempotent); the peer's next broadcast fails."""
        group, self._group = self._group, None
        self._error = self._error or RuntimeError("channel closed")
        if group is not None:
            try:
                group.abort() if hasattr(group, "abort") else None
            except Exception:  # noqa: BLE001,S110 - best effort: the group is dropped anyway
                pass
        self._store = None
        self._staging = None
