"""An endless, sharded, resumable stream of prompts for one inference worker.

Worker ``w`` of ``n`` owns indices ``w, w + n, w + 2n, ...`` (never seed-dependent, so shards
stay disjoint whatever the workers' seeds). Each epoch walks the shard in an order seeded by
``(seed, worker_id, epoch)``; a resumed stream continues with exactly the prompt that was due.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any


class PromptStream:
    """Infinite stream over one worker's shard of a dataset, reshuffled every epoch.

    Args:
        dataset (Sequence[dict]): Examples (e.g. a ``PromptDataset``); ``dataset[i]`` is a dict.
        worker_id (int): This worker's rank, in ``[0, num_workers)``.
        shuffle (bool): Shuffle the shard every epoch; if ``False`` read it in index order.

    Raises:
        ValueError: If ``worker_id`` is out of range or the worker's shard would be empty
            (more workers than examples).
    """

    def __init__(
        self,
        dataset: Sequence[dict[str, Any]],
        worker_id: int,
        num_workers: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"worker_id must be in [0, {num_workers}), got {worker_id}")
        if worker_id >= len(dataset):
            raise ValueError(
                f"worker {worker_id} of {num_workers} would get an empty shard: the dataset has "
                f"only {len(dataset)} examples; use at most {len(dataset)} workers or more data"
            )
        self.dataset = dataset
        self.worker_id = worker_id
        self.num_workers = num_workers
        self.seed = seed
        self.shuffle = shuffle
        self.shard = list(range(worker_id, len(dataset), num_workers))
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(self.epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        """Dataset indices of the shard in the order they are read during ``epoch``."""
        if not self.shuffle:
            return list(self.shard)
        # A string seed is hashed with SHA-512 by `random`, so the order is the same in every
        # process and Python run (unlike `hash()`), and distinct per (seed, worker, epoch).
        order = list(self.shard)
        random.Random(f"prompt-stream:{self.seed}:{self.worker_id}:{epoch}").shuffle(order)
        return order

    def __len__(self) -> int:
        """Number of examples in this worker's shard (one epoch)."""
        return len(self.shard)

    def next_batch(self, batch_size: int) -> list[dict[str, Any]]:
        """The next ``batch_size`` examples (it may exceed the shard), continuing into the next
        epoch when needed: copies, each with its dataset ``"index"`` added.

        Raises:
            ValueError: If ``batch_size`` is negative.
        """
        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0, got {batch_size}")
        batch = []
        for _ in range(batch_size):
            index = self._order[self.position]
            batch.append({**self.dataset[index], "index": index})
            self.position += 1
            if self.position == len(self._order):  # roll over eagerly: position < shard size
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
        return batch

    def next_fitting(
        self, count: int, token_ids: Callable[[dict[str, Any]], list[int]], max_tokens: int
    ) -> tuple[list[tuple[dict[str, Any], list[int]]], int]:
        """The next ``count`` examples whose prompts fit ``max_tokens``, with their token ids.

        Returns:
            tuple: ``(example, token ids)`` pairs, and how many examples were skipped.

        Raises:
            ValueError: If a whole shard's worth of examples in a row is too long.
        """
        prompts, skipped, skipped_in_a_row = [], 0, 0
        while len(prompts) < count:
            [example] = self.next_batch(1)
            ids = token_ids(example)
            if len(ids) <= max_tokens:
                prompts.append((example, ids))
                skipped_in_a_row = 0
                continue
            skipped += 1
            skipped_in_a_row += 1
            if skipped_in_a_row >= len(self):
                raise ValueError(
                    f"inference[{self.worker_id}]: every prompt of its shard is longer than "
                    f"max_prompt_tokens={max_tokens}"
                )
        return prompts, skipped

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> dict[str, Any]:
        return self.next_batch(1)[0]

    def state_dict(self) -> dict[str, Any]:
        """Where the stream is, plus the settings a resume must share for an exact continuation."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "worker_id": self.worker_id,
            "num_workers": self.num_workers,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_size": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from ``state_dict``): the next prompt is the one that was due.

        Raises:
            ValueError: If the state was saved with another worker layout, seed, shuffle setting
                or dataset size, or its position is out of range.
        """
        for key in ("worker_id", "num_workers", "seed", "shuffle", "dataset_size"):
            current = self.state_dict()[key]
            if key in state and state[key] != current:
                raise ValueError(
                    f"PromptStream state has {key}={state[key]!r} but this stream has "
                    f"{key}={current!r}; resuming would not continue the saved stream"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self.shard):
            raise ValueError(
                f"PromptStream state has epoch={epoch}, position={position}; expected epoch >= 0 "
                f"and position in [0, {len(self.shard)})"
            )
        self.epoch, self.position = epoch, position
        self._order = self._epoch_order(epoch)
