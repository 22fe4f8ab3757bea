"""Names of the concurrency groups of the actors at both ends of a weight transfer, in a
module of their own so that both sides import them without importing each other."""

from __future__ import annotations

# Own threads, so neither waits behind generation or behind a slow transfer.
COLLECTOR_WEIGHTS_GROUP = "weights"
COLLECTOR_HEALTH_GROUP = "health"
COLLECTOR_CONCURRENCY_GROUPS = {COLLECTOR_WEIGHTS_GROUP: 1, COLLECTOR_HEALTH_GROUP: 1}

# Transport calls wait neither behind a training step nor behind a send to a dead collector
# timing out; transfers to different collectors may overlap.
TRAINER_CHANNEL_GROUP = "weight_channel"
TRAINER_CONCURRENCY_GROUPS = {TRAINER_CHANNEL_GROUP: 8}
