"""Weight sync: the trainer's weights into the collectors' vLLM engines, verified.

One package, one module per part:

* `base`: the interfaces of a transport: `WeightTransport` (the driver's: gather, send,
  finish, forget) and its two ends, `TrainerEnd` and `CollectorEnd`; `transports`: the one
  place a transport is chosen (``weight_sync.transport``).
* `object_store` and `collective`: the two transports, each one module with its three parts
  (trainer end, collector end, driver side); `channel`: the collective transport's two-rank
  process groups (gloo on CPU, NCCL on GPU).
* `publisher`: `WeightPublisher`, the trainer's side: each gathered version published through
  the transport the driver uses.
* `receiver`: `EngineWeights`, the collector's side: updates received, loaded between two
  engine steps or batches, verified, rolled back, and the version of every sampled token.
* `engine`: the vLLM worker extension that reloads weights in place, and `WeightReceiver`,
  the pending update.
* `checksum`: one definition of "these weights" for both ends.
* `concurrency`: the actors' concurrency groups that transfers and heartbeats run in.
* `sync`: `WeightSync`, the driver: gather, send, catch up a replaced collector, verify.

Import the modules directly (``from grpo.weights.sync import WeightSync``): this package
imports nothing, so the vLLM worker loading `engine` does not pull in Ray's side.
"""
