"""Weight sync, driver side: gather from the trainers, send to the collectors, verify.

The driver keeps the last gathered payload, which a replacement collector needs to catch up.
Transfers to one collector run one at a time, which keeps versions in order. A failed transfer
never stops the run: it is sent again once on a fresh connection, and a collector that fails
that too, or does not answer, is replaced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from grpo.config.sections import WeightSyncConfig
from grpo.errors import ActorFailedError, TrainerDiedError, WeightTransferError, describe
from grpo.observability import metric_names as names
from grpo.weights.concurrency import (
    COLLECTOR_HEALTH_GROUP,
    COLLECTOR_WEIGHTS_GROUP,
    TRAINER_CHANNEL_GROUP,
)

log = logging.getLogger("grpo")

# A collector that does not answer a heartbeat within this is frozen, and is replaced.
HEARTBEAT_TIMEOUT_S = 10.0
# A vLLM engine loading a model; a transfer waits this long for a collector to start.
START_UP_LIMIT_S = 600.0

GetAll = Callable[[list[Any], str], list[Any]]


class WeightSync:
    """Moves the policy from the trainers to the collectors and proves it arrived.

    Args:
        get_all: ``get_all(refs, what)``: `ray.get` that names a failed actor.
        wait_for_receipt: Return only once every collector holds the new weights, as
            synchronous (on-policy) runs need; otherwise a batch launched right after a sync
            may still generate with the old ones, labelled with their version.
        config: The ``weight_sync:`` options; None: the defaults.

    A collector that cannot receive lands in ``failed`` as ``(index, collector, error)``;
    nothing more is sent to it. The caller replaces it and catches the replacement up
    (`catch_up`).
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
        self.failed: list[tuple[int, Any, Exception]] = []
        self.retries = 0  # transfers sent again on a fresh connection
        self.last_payload: dict[str, Any] | None = None
        self._sender: Any = None  # trainer rank 0, which holds the gathered weights
        # By actor id, since a replacement keeps the name of the collector it replaces.
        self._connected: dict[str, str] = {}
        # Collectors seen started (`_wait_started`): Ray's GCS is asked once per collector.
        self._started: set[str] = set()
        self._transfers: dict[str, tuple[str, Any, Any]] = {}

    def sync(self, trainers: list[Any], collectors: list[Any]) -> tuple[int, dict[str, float]]:
        """Gather the trainers' weights once and send them to every collector.

        Every trainer rank takes part in the gather.

        Returns:
            tuple[int, dict[str, float]]: The new policy version, and the gather, transfer and
            total times.
        """
        start = time.perf_counter()
        # Trainer rank 0 holds one version: a send of the previous one that had not started
        # yet would find it replaced, and its collector would wait for a broadcast forever.
        for index, collector in enumerate(list(collectors)):
            self._settle(index, collector)
        gather_start = time.perf_counter()
        transport = self.config.transport
        gathered = [trainer.publish_weights.remote(transport) for trainer in trainers]
        self._get_all(gathered[1:], "the weight gather")
        payload = self._get_all([gathered[0]], "training[0] weight gather")[0]
        gather_time = time.perf_counter() - gather_start
        self._sender = trainers[0]
        self.last_payload = payload
        self._send(list(enumerate(collectors)), payload)
        end = time.perf_counter()
        return payload["version"], {
            names.TRAIN_PERF_TIME_WEIGHT_GATHER: gather_time,
            names.TRAIN_PERF_TIME_WEIGHT_TRANSFER: end - start - gather_time,
            names.TRAIN_PERF_TIME_WEIGHT_SYNC: end - start,
        }

    def catch_up(
        self, collector: Any, state: dict[str, Any] | None, name: str, index: int = 0
    ) -> None:
        """Bring a replacement collector to a finished batch's ``state`` and the latest weights.

        ``state`` is the old collector's after its last finished batch.
        """
        if state is not None:
            # The stream position only: the version is that of the weights it holds.
            self._get_all([collector.load_state_dict.remote(state)], f"{name} restart")
        self._forget(name)
        if self.last_payload is not None:
            self._send([(index, collector)], self.last_payload)
            if not self.wait_for_receipt:
                # Else its first batch, sampled with its start-up weights, would be dropped stale.
                self._settle(index, collector)

    def _send(self, collectors: list[tuple[int, Any]], payload: dict[str, Any]) -> None:
        """Send ``payload`` to each ``(index, collector)``, once its previous transfer is done."""
        for index, collector in collectors:
            if not self._settle(index, collector):
                self._start(f"inference[{index}]", collector, payload)
        if self.wait_for_receipt:
            for index, collector in collectors:
                self._settle(index, collector)

    def _start(self, name: str, collector: Any, payload: dict[str, Any]) -> None:
        """Start sending ``payload`` to ``collector``, connecting first if needed."""
        config, key = self.config, collector._actor_id.hex()
        if key in self._transfers:
            raise RuntimeError(f"{name}: finish the weight transfer in flight before the next")
        trainer, connection = self._sender, None
        if key not in self._connected:
            connect = trainer.connect_weights.options(concurrency_group=TRAINER_CHANNEL_GROUP)
            connecting = connect.remote(name, config.timeout_s, config.bucket_bytes)
            connection = self._get_all([connecting], f"training[0] connecting to {name}")[0]
            self._connected[key] = name
        version = payload["version"]
        send = trainer.send_weights.options(concurrency_group=TRAINER_CHANNEL_GROUP)
        sent = send.remote(name, version)
        receive = collector.receive_weights.options(concurrency_group=COLLECTOR_WEIGHTS_GROUP)
        received = receive.remote(
            payload["weights"],
            version,
            payload["checksum"],
            payload["probe"],
            config.transport,
            connection,
        )
        self._transfers[key] = (name, sent, received)

    def _finish(self, collector: Any) -> None:
        """Wait for the transfer in flight to ``collector``, if any, at most `wait_limit_s`.

        A dead collector is left to its generation call, which has it replaced; any other
        failure drops the connection.

        Raises:
            WeightTransferError: The collector did not receive, or training[0] did not send,
                within the wait limit.
            TrainerDiedError: Trainer rank 0 died sending.
        """
        from ray.exceptions import RayActorError

        key = collector._actor_id.hex()
        transfer = self._transfers.pop(key, None)
        if transfer is None:
            return
        name, sent, received = transfer
        try:
            self._wait(name, [received, sent])
        except RayActorError as error:
            self._connected.pop(key, None)
            if _died(received):
                log.warning("%s died during a weight transfer; it will be replaced", name)
                return
            raise TrainerDiedError(
                f"training[0] died sending weights to {name}: {describe(error)}"
            ) from error
        except Exception:
            self._connected.pop(key, None)
            raise

    def _forget(self, name: str) -> None:
        """Drop the connection and transfer of a collector that is replaced or sent again."""
        for key in [key for key, connected in self._connected.items() if connected == name]:
            del self._connected[key]
            self._transfers.pop(key, None)

    def wait_limit_s(self) -> float:
        """How long `_finish` waits: the transfer's own timeout, and time to report it."""
        return 1.5 * self.config.timeout_s + 10.0

    def _wait(self, name: str, refs: list[Any]) -> None:
        """Wait for a transfer's calls in order, within `wait_limit_s` in all.

        In order, so that a dead collector does not wait out the trainer's timeout.

        Raises:
            WeightTransferError: Naming the collector and the cause.
            RayActorError: The actor of a call died.
        """
        import ray

        deadline = time.monotonic() + self.wait_limit_s()
        for ref in refs:
            ray.wait([ref], timeout=max(deadline - time.monotonic(), 0.0))
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError as error:
                raise WeightTransferError(
                    f"weight transfer to {name} did not finish within {self.wait_limit_s():.0f} s "
                    f"(weight_sync.timeout_s={self.config.timeout_s:g})"
                ) from error
            except ray.exceptions.RayActorError:
                raise
            except ray.exceptions.RayError as error:  # the call raised, or its result was lost
                cause = getattr(error, "cause", None)
                lines = str(cause if cause is not None else error).splitlines()
                raise WeightTransferError(
                    f"weight transfer to {name} failed: {lines[-1] if lines else error}"
                ) from error

    def _settle(self, index: int, collector: Any) -> bool:
        """Finish the transfer to ``collector``: retry once, then put it in ``failed``.

        Returns:
            bool: True when nothing more is to be sent to it now: the latest payload was sent
            again, or it failed.
        """
        if any(failed is collector for _, failed, _ in self.failed):
            return True
        name = f"inference[{index}]"
        self._wait_started(collector)
        try:
            self._finish(collector)
            return False
        except WeightTransferError as error:
            failure: Exception = error
        if self._answers(collector):
            self.retries += 1
            log.warning("%s; sending the weights again on a fresh channel", failure)
            self._forget(name)  # the next send connects again
            try:
                self._start(name, collector, self.last_payload)
                self._finish(collector)
                return True
            except TrainerDiedError:
                raise
            except (WeightTransferError, ActorFailedError) as error:
                failure = error
        log.warning("%s; replacing %s", failure, name)
        self._forget(name)
        self.failed.append((index, collector, failure))
        return True

    def _wait_started(self, collector: Any) -> None:
        """Wait (at most `START_UP_LIMIT_S`) for a collector whose constructor still runs.

        Ray's GCS is asked once per collector, not at every sync (its actor table was a tenth
        of the demo driver's Python time): a collector that started stays started, and its
        replacement is another actor.
        """
        import ray

        key = collector._actor_id.hex()
        if key in self._started:
            return
        try:
            if ray._private.state.actors(key).get("State") == "ALIVE":
                self._started.add(key)
                return
        except Exception:  # noqa: BLE001 - a private API: if it moved, do not wait
            return
        ready, _ = ray.wait([collector.__ray_ready__.remote()], timeout=START_UP_LIMIT_S)
        if ready:
            self._started.add(key)

    @staticmethod
    def _answers(collector: Any) -> bool:
        """Whether ``collector`` answers a heartbeat (a frozen one never does)."""
        import ray

        ref = collector.heartbeat.options(concurrency_group=COLLECTOR_HEALTH_GROUP).remote()
        try:
            ray.get(ref, timeout=HEARTBEAT_TIMEOUT_S)
            return True
        except Exception:  # noqa: BLE001 - no answer in time, or dead: either way, replace it
            return False

    def verify(self, trainers: list[Any], collectors: list[Any]) -> bool:
        """Check that every collector computes with exactly the trainers' current weights.

        Transfers in flight are finished and pending weights applied first.

        Returns:
            bool: True if every collector's checksum equals the trainer's; False also when a
            collector could not receive (it is in ``failed``: check again once replaced).
        """
        trainer_sums = self._get_all(
            [t.weights_checksum.remote() for t in trainers], "trainer checksum"
        )
        expected = trainer_sums[0]
        for index, collector in enumerate(collectors):
            self._settle(index, collector)
        if self.failed:
            return False
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


def _died(ref: Any) -> bool:
    """Whether the call behind ``ref`` failed because its actor died."""
    import ray
    from ray.exceptions import RayActorError

    try:
        ray.get(ref, timeout=0)
    except RayActorError:
        return True
    except Exception:  # noqa: BLE001 - failed otherwise, or still running
        return False
    return False
