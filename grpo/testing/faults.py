"""Faults a run must survive, injected into live actors for tests and drills (each runs inside
an actor through ``actor.__ray_call__``, so it lives in an importable module)."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any


def fail_next_weight_receive(collector: Any, times: int = 1) -> None:
    """The collector's next ``times`` weight transfers fail before it joins its channel: the
    trainer's side then times out, as with a collector that never joined."""
    from grpo.weights.channel import WeightChannelError

    weights = collector.weights
    original = weights.receive
    left = [times]

    def receive(*args: Any, **kwargs: Any) -> Any:
        left[0] -= 1
        if left[0] == 0:
            weights.receive = original
        raise WeightChannelError(f"weight channel to {weights.owner}: did not join (injected)")

    weights.receive = receive


def fail_next_two_weight_receives(collector: Any) -> None:
    """`fail_next_weight_receive` twice: the transfer sent again fails too, and the collector is
    replaced."""
    fail_next_weight_receive(collector, times=2)


def fail_next_batch(collector: Any) -> None:
    """The collector's next generation batch raises `WeightSyncError` (as after updates that
    kept failing verification): an error inside the actor, which stops the run."""
    from grpo.weights.checksum import WeightSyncError

    weights = collector.weights

    def start_batch() -> None:
        raise WeightSyncError("3 weight updates in a row failed verification (injected)")

    weights.start_batch = start_batch


def delay_next_weight_send(trainer: Any, seconds: float = 3.0) -> None:
    """Trainer rank 0's next weight send starts ``seconds`` late (once), as its thread can on a
    busy machine while the next training step runs."""
    sender = trainer.weight_sender
    original = sender.send

    def send(*args: Any, **kwargs: Any) -> float:
        sender.send = original
        time.sleep(seconds)
        return original(*args, **kwargs)

    sender.send = send


def hang_engine_step(collector: Any) -> None:
    """The collector's vLLM engine step never returns (as a wedged kernel or driver would)."""
    collector.llm.llm_engine.step = lambda: time.sleep(10**6)


def hang_training_step(trainer: Any) -> None:
    """The trainer's next training step never returns."""
    trainer._plan_micro_batches = lambda batch: time.sleep(10**6)


def freeze(actor: Any) -> None:
    """SIGSTOP the actor's process (on this machine), never continued."""
    import ray

    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGSTOP)


# Handlings (a replacement, or a transfer sent again) a fault causes, when not one: a transfer
# that fails twice is sent again, then its collector is replaced.
_HANDLINGS = {fail_next_two_weight_receives: 2}


def faults_at_steps(run: Any, faults: list[tuple[int, str, Any]]) -> list[str]:
    """In a background thread, inject each ``(step, actor name, fault)`` once the run reached
    that step, every earlier fault was handled (a replacement, or a transfer sent again) and one
    more step ended: a transfer sent again is finished at the next sync, and a fault injected
    before would fail that one instead of the transfer it is meant for.

    Args:
        faults (list): ``(step, name, fault)``: ``fault`` is `freeze` or a function run in
            the actor of that name then (a replacement after an earlier fault).

    Returns:
        list[str]: Filled with ``"fault@step"`` as each is injected (or why it failed).
    """
    import ray

    from grpo.orchestrator.supervisor import role_and_index

    done: list[str] = []

    def handled() -> int:
        return len(run.recoveries) + run.weights.retries

    def inject() -> None:
        expected = 0  # handlings the faults injected so far cause
        for step, name, fault in faults:
            deadline = time.monotonic() + 300
            while handled() < expected and time.monotonic() < deadline:
                time.sleep(0.05)
            settled = run.state.step + 1 if expected else 0
            while run.state.step < max(step, settled) and time.monotonic() < deadline:
                time.sleep(0.05)
            actor = run.actors.actor(*role_and_index(name))
            try:
                if fault is freeze:
                    freeze(actor)
                else:
                    ray.get(actor.__ray_call__.remote(fault))
                done.append(f"{fault.__name__}@{run.state.step}")
                expected += _HANDLINGS.get(fault, 1)
            except Exception as error:  # noqa: BLE001 - the caller's assertion reports it
                done.append(f"{fault.__name__}@{step} failed: {error!r}")

    threading.Thread(target=inject, daemon=True).start()
    return done
