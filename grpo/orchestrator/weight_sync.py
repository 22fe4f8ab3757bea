"""Weight sync, driver side: gather from the trainers, hand to collectors, verify.

The worker side (checksums, name conversion, the vLLM update) is `grpo.workers.weight_sync`.
This part owns the last gathered payload (a reference: the weights stay in the object store),
which is what a replacement collector needs to catch up, and the version of the weights
collectors are started from (the base model's 0, or a checkpoint's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from ray.exceptions import RayActorError

from grpo.orchestrator.errors import ActorFailedError

log = logging.getLogger("grpo")


class WeightSync:
    """Moves the policy from the trainers to the collectors and proves it arrived.

    Args:
        get_all (Callable): ``get_all(refs, what)``: `ray.get` that names a failed actor
            (`ActorSupervisor.get_all`).
        wait_for_receipt (bool): Return only once every collector holds the new weights. A
            collector is a threaded actor: without the wait, a batch launched right after a
            sync may start before `receive_weights` has run and generate with the old weights.
            Synchronous runs (on-policy by contract) need it; an asynchronous run labels every
            trajectory with the version that generated it, so it need not wait.
    """

    def __init__(
        self, get_all: Callable[[list[Any], str], list[Any]], wait_for_receipt: bool = False
    ) -> None:
        self._get_all = get_all
        self.wait_for_receipt = wait_for_receipt
        self.start_version = 0  # of the weights new collectors load from disk
        self.last_payload: dict[str, Any] | None = None

    def sync(self, trainers: list[Any], collectors: list[Any]) -> tuple[int, dict[str, float]]:
        """Gather the trainers' weights once and hand the same object to every collector.

        Args:
            trainers (list): Trainer actors (every rank takes part in the gather).
            collectors (list): Collector actors; each applies the weights between batches.

        Returns:
            tuple[int, dict[str, float]]: The new policy version, and gather and sync timings.
        """
        start = time.perf_counter()
        gathered = [t.gather_hf_weights.remote() for t in trainers]
        self._get_all(gathered[1:], "trainer weight gather")
        payload = self._get_all([gathered[0]], "trainer[0] weight gather")[0]
        gather_time = time.perf_counter() - start
        # The trainer put the weights in the object store once; every collector reads that
        # same object, and applies it between generation batches.
        self._send(collectors, payload)
        self.last_payload = payload
        return payload["version"], {
            "train_actor_performance/time_weight_gather (s)": gather_time,
            "train_actor_performance/time_weight_sync (s)": time.perf_counter() - start,
        }

    def catch_up(self, collector: Any, state: dict[str, Any] | None, name: str) -> None:
        """Bring a replacement collector to a finished batch's ``state`` and the latest weights.

        Args:
            collector: The new collector, started from the weights of ``start_version``.
            state (dict | None): The old collector's state after its last finished batch.
            name (str): The collector's name, for errors.
        """
        if state is not None:
            # The replacement holds the weights it was started from; the latest ones follow.
            state = {**state, "policy_version": self.start_version}
            self._get_all([collector.load_state_dict.remote(state)], f"{name} restart")
        if self.last_payload is not None:
            self._send([collector], self.last_payload)

    def _send(self, collectors: list[Any], payload: dict[str, Any]) -> None:
        receipts = [
            collector.receive_weights.remote(
                payload["weights"], payload["version"], payload["checksum"], payload["probe"]
            )
            for collector in collectors
        ]
        if not self.wait_for_receipt:
            return
        for receipt in receipts:
            try:
                self._get_all([receipt], "collector weight receipt")
            except ActorFailedError as error:
                # A dead collector is left to its generation call, which finds it and has it
                # replaced (the replacement catches up); any other failure stops the run.
                if not isinstance(error.__cause__, RayActorError):
                    raise

    def verify(self, trainers: list[Any], collectors: list[Any]) -> bool:
        """Check that every collector computes with exactly the trainers' current weights.

        Pending weights are applied first.

        Returns:
            bool: True if every collector's checksum equals the trainer's.
        """
        trainer_sums = self._get_all(
            [t.weights_checksum.remote() for t in trainers], "trainer checksum"
        )
        expected = trainer_sums[0]
        self._get_all(
            [c.apply_pending_weights.remote() for c in collectors], "collector weight update"
        )
        got = self._get_all(
            [c.get_weights_checksum.remote() for c in collectors], "collector checksum"
        )
        in_sync = all(checksum == expected for checksum in got)
        if not in_sync:
            log.error("collector weights differ from the trainer's: %s vs %s", got, expected)
        return in_sync
