"""The concurrency groups of the two actors at the ends of a weight transfer.

The actors declare them (`SyncLLMCollector.as_remote`, `PyTorchActorModel.as_remote`); the
callers pick them with ``.options(concurrency_group=...)``: the driver's transfers
(`grpo.weights.sync`) and its heartbeat. This module holds names only, so that both sides import
them without importing each other.
"""

from __future__ import annotations

# A collector receives weights on a thread of its own and answers the driver's heartbeat on
# another, so neither ever waits for a free thread behind generation (its default group) or
# behind a slow transfer.
COLLECTOR_WEIGHTS_GROUP = "weights"
COLLECTOR_HEALTH_GROUP = "health"
COLLECTOR_CONCURRENCY_GROUPS = {COLLECTOR_WEIGHTS_GROUP: 1, COLLECTOR_HEALTH_GROUP: 1}

# Trainer rank 0 runs the transport's calls (connect: a rendezvous; send: a broadcast) here: they
# wait neither behind a training step nor behind a send to a dead collector that is timing
# out. Transfers to different collectors may overlap; the driver keeps one per channel at a
# time.
TRAINER_CHANNEL_GROUP = "weight_channel"
TRAINER_CONCURRENCY_GROUPS = {TRAINER_CHANNEL_GROUP: 8}
