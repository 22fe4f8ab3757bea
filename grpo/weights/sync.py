"""Weight sync, driver side: gather from the trainers, send to the collectors, verify.

This part owns the last gathered payload (its metadata, and with the object store a reference
to the weights), which is what a replacement collector needs to catch up, and the version of
the weights collectors are started from (the base model's 0, or a checkpoint's). How the
weights travel is the transport's business (`grpo.weights.base.WeightTransport`, chosen once
by `grpo.weights.transports.make_transport`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from grpo.config.sections import WeightSyncConfig
from grpo.weights.base import GetAll
from grpo.weights.transports import make_transport

log = logging.getLogger("grpo")


class WeightSync:
    """Moves the policy from the trainers to the collectors and proves it arrived.

    Args:
        get_all (GetAll): ``get_all(refs, what)``: `ray.get` that names a failed actor
            (`ActorSupervisor.get_all`).
        wait_for_receipt (bool): Return only once every collector holds the new weights. A
            collector is a threaded actor: without the wait, a batch launched right after a
            sync may start before the weights arrived and generate with the old ones.
            Synchronous runs (on-policy by contract) need it; an asynchronous run labels every
            trajectory with the version that generated it, so it need not wait. (A transport
            still finishes a collector's previous transfer before its next one, which keeps
            versions in order.)
        config (WeightSyncConfig | None): The ``weight_sync:`` options; None: the defaults.
    """

    def __init__(
        self,
        get_all: GetAll,
        wait_for_receipt: bool = False,
        config: WeightSyncConfig | None = None,
    ) -> None:
        self._get_all = get_all
        self.wait_for_receipt = wait_for_receipt
        self.config = config or WeightSyncConfig()
        self.transport = make_transport(self.config, get_all)
        self.start_version = 0  # of the weights new collectors load from disk
        self.last_payload: dict[str, Any] | None = None
        self._sender: Any = None  # trainer rank 0, which holds the gathered weights

    def sync(self, trainers: list[Any], collectors: list[Any]) -> tuple[int, dict[str, float]]:
        """Gather the trainers' weights once and send them to every collector.

        Args:
            trainers (list): Trainer actors (every rank takes part in the gather).
            collectors (list): Collector actors; each loads the weights between two engine
                steps (in flight) or before its next batch.

        Returns:
            tuple[int, dict[str, float]]: The new policy version, and timings: the gather,
            the transfer (launching it, or the whole of it when the sync waits for receipt)
            and the total.
        """
        start = time.perf_counter()
        gathered = self.transport.gather(trainers)
        self._get_all(gathered[1:], "trainer weight gather")
        payload = self._get_all([gathered[0]], "trainer[0] weight gather")[0]
        gather_time = time.perf_counter() - start
        self._sender = trainers[0]
        self.last_payload = payload
        self._send([(f"collector[{i}]", c) for i, c in enumerate(collectors)], payload)
        end = time.perf_counter()
        return payload["version"], {
            "train_actor_performance/time_weight_gather (s)": gather_time,
            "train_actor_performance/time_weight_transfer (s)": end - start - gather_time,
            "train_actor_performance/time_weight_sync (s)": end - start,
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
        self.transport.forget(name)
        if self.last_payload is not None:
            self._send([(name, collector)], self.last_payload)

    def _send(self, named_collectors: list[tuple[str, Any]], payload: dict[str, Any]) -> None:
        for name, collector in named_collectors:
            self.transport.send(self._sender, name, collector, payload)
        if self.wait_for_receipt:
            for _, collector in named_collectors:
                self.transport.finish(collector)

    def verify(self, trainers: list[Any], collectors: list[Any]) -> bool:
        """Check that every collector computes with exactly the trainers' current weights.

        Transfers in flight are finished and pending weights applied first.

        Returns:
            bool: True if every collector's checksum equals the trainer's.
        """
        trainer_sums = self._get_all(
            [t.weights_checksum.remote() for t in trainers], "trainer checksum"
        )
        expected = trainer_sums[0]
        for collector in collectors:
            self.transport.finish(collector)
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
