"""Weight sync, driver side: gather from the trainers, hand to collectors, verify.

The worker side (checksums, name conversion, the vLLM update) is `grpo.workers.weight_sync`,
the channels of the collective transport `grpo.workers.weight_channel`. This part owns the
last gathered payload (its metadata, and with the object store a reference to the weights),
which is what a replacement collector needs to catch up, the open channels, and the version of
the weights collectors are started from (the base model's 0, or a checkpoint's).

Transports (``weight_sync.transport``):

* ``collective``: trainer rank 0 holds the gathered weights and broadcasts them to each
  collector over that pair's own process group (gloo on CPU, NCCL on GPU); only names,
  shapes, dtypes, version, checksum and probe go through Ray. A channel is opened at a
  collector's first sync (its replacement's catch-up for a replaced one).
* ``object_store``: the trainer puts the weights into Ray's object store once and every
  collector reads that object.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from grpo.config.sections import WeightSyncConfig
from grpo.orchestrator.errors import ActorFailedError

log = logging.getLogger("grpo")

# The trainer actor's concurrency group for channel calls: a rendezvous or a transfer does not
# wait behind a training step, nor behind a send to a dead collector that is timing out.
# Transfers to different collectors may overlap; the driver keeps one per channel at a time.
CHANNEL_GROUP = "weight_channel"
TRAINER_CONCURRENCY_GROUPS = {CHANNEL_GROUP: 8}


class WeightSync:
    """Moves the policy from the trainers to the collectors and proves it arrived.

    Args:
        get_all (Callable): ``get_all(refs, what)``: `ray.get` that names a failed actor
            (`ActorSupervisor.get_all`).
        wait_for_receipt (bool): Return only once every collector holds the new weights. A
            collector is a threaded actor: without the wait, a batch launched right after a
            sync may start before the weights arrived and generate with the old ones.
            Synchronous runs (on-policy by contract) need it; an asynchronous run labels every
            trajectory with the version that generated it, so it need not wait. (With the
            collective transport a collector's previous transfer is still waited for before
            its next one, which keeps versions in order on its channel.)
        config (WeightSyncConfig | None): The ``weight_sync:`` options; None: the defaults.
    """

    def __init__(
        self,
        get_all: Callable[[list[Any], str], list[Any]],
        wait_for_receipt: bool = False,
        config: WeightSyncConfig | None = None,
    ) -> None:
        self._get_all = get_all
        self.wait_for_receipt = wait_for_receipt
        self.config = config or WeightSyncConfig()
        self.start_version = 0  # of the weights new collectors load from disk
        self.last_payload: dict[str, Any] | None = None
        self._sender: Any = None  # trainer rank 0, which holds the weights channels send
        # Collective transport, by collector actor id: the open channels' names, and the
        # transfer in flight on each, as (name, trainer's send ref, collector's receive ref).
        self._channels: dict[str, str] = {}
        self._transfers: dict[str, tuple[str, Any, Any]] = {}

    def sync(self, trainers: list[Any], collectors: list[Any]) -> tuple[int, dict[str, float]]:
        """Gather the trainers' weights once and send them to every collector.

        Args:
            trainers (list): Trainer actors (every rank takes part in the gather).
            collectors (list): Collector actors; each applies the weights between batches.

        Returns:
            tuple[int, dict[str, float]]: The new policy version, and timings: the gather,
            the transfer (launching it, or the whole of it when the sync waits for receipt)
            and the total.
        """
        start = time.perf_counter()
        transport = self.config.transport
        gathered = [t.gather_hf_weights.remote(transport) for t in trainers]
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

        With the collective transport the replacement joins a new channel with trainer rank 0.

        Args:
            collector: The new collector, started from the weights of ``start_version``.
            state (dict | None): The old collector's state after its last finished batch.
            name (str): The collector's name, for errors.
        """
        if state is not None:
            # The replacement holds the weights it was started from; the latest ones follow.
            state = {**state, "policy_version": self.start_version}
            self._get_all([collector.load_state_dict.remote(state)], f"{name} restart")
        # Forget the dead one's channel (the trainer closes its end when the new one opens).
        for key in [key for key, channel in self._channels.items() if channel == name]:
            del self._channels[key]
            self._transfers.pop(key, None)
        if self.last_payload is not None:
            self._send([(name, collector)], self.last_payload)

    def _send(self, named_collectors: list[tuple[str, Any]], payload: dict[str, Any]) -> None:
        if self.config.transport == "collective":
            for name, collector in named_collectors:
                self._start_transfer(name, collector, payload)
            if self.wait_for_receipt:
                for _, collector in named_collectors:
                    self._finish_transfer(collector)
            return
        receipts = [
            collector.receive_weights.remote(
                payload["weights"], payload["version"], payload["checksum"], payload["probe"]
            )
            for _, collector in named_collectors
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

    def _start_transfer(self, name: str, collector: Any, payload: dict[str, Any]) -> None:
        """Trainer rank 0 broadcasts, ``collector`` receives; a new channel is opened first."""
        # Keyed by actor id, not name: a replacement has the name of the collector it replaces.
        config, key = self.config, collector._actor_id.hex()
        self._finish_transfer(collector)  # the channel carries one transfer at a time
        join = None
        if key not in self._channels:
            address = self._get_all(
                [
                    self._sender.open_weight_channel.options(
                        concurrency_group=CHANNEL_GROUP
                    ).remote(name, config.timeout_s)
                ],
                f"trainer[0] opening the weight channel to {name}",
            )[0]
            join = {**address, "timeout_s": config.timeout_s}
            self._channels[key] = name
        version = payload["version"]
        sent = self._sender.send_weights.options(concurrency_group=CHANNEL_GROUP).remote(
            name, version, config.bucket_bytes
        )
        received = collector.receive_weights_over_channel.remote(
            version,
            payload["specs"],
            config.bucket_bytes,
            payload["checksum"],
            payload["probe"],
            join,
        )
        self._transfers[key] = (name, sent, received)

    def _finish_transfer(self, collector: Any) -> None:
        """Wait for the transfer in flight to ``collector``, if any.

        A dead collector is left to its generation call, which finds it and has it replaced
        (the replacement catches up over a new channel; the trainer's send times out and
        closes the old one). A failure of a live collector or of the trainer stops the run.

        Raises:
            ActorFailedError: The transfer failed, naming the collector or trainer[0].
        """
        key = collector._actor_id.hex()  # as in _start_transfer
        transfer = self._transfers.pop(key, None)
        if transfer is None:
            return
        name, sent, received = transfer
        try:
            ray.get(received)
        except RayActorError:
            self._channels.pop(key, None)
            log.warning("%s died during a weight transfer; it will be replaced", name)
            return
        except RayTaskError as error:
            self._channels.pop(key, None)
            raise ActorFailedError(f"{name} failed to receive weights: {error}") from error
        try:
            ray.get(sent)
        except (RayActorError, RayTaskError) as error:
            self._channels.pop(key, None)
            raise ActorFailedError(
                f"trainer[0] failed to send weights to {name}: {error}"
            ) from error

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
            self._finish_transfer(collector)
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
