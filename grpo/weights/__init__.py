"""Weight sync: the trainer's weights into the collectors' vLLM engines, verified.

One package, one module per part:

* `base`: the two ends of a transport, `SendingEnd` (inside trainer rank 0) and `ReceivingEnd`
  (inside a collector); `transports`: the one place a transport is chosen
  (``weight_sync.transport``): each actor builds the end of that transport only.
* `object_store` and `collective`: the two transports, each one module with its two ends;
  `channel`: the collective transport's two-rank process groups (gloo on CPU, NCCL on GPU).
* `receiver`: `EngineWeights`, the collector's side: updates received and loaded between two
  engine steps or between batches (the engine's step loop, which records the version of every
  sampled token, is `grpo.workers.vllm_engine.EngineLoop`).
* `verify`: the checks of a loaded update (checksum, probe logprobs) and the rollback.
* `engine`: the vLLM worker extension that reloads weights in place, and `WeightReceiver`,
  the pending update.
* `checksum`: one definition of "these weights" for both ends.
* `concurrency`: the actors' concurrency groups that transfers and heartbeats run in.
* `sync`: `WeightSync`, the driver: gather, send, catch up a replaced collector, verify.

Import the modules directly (``from grpo.weights.sync import WeightSync``): this package
imports nothing, so the vLLM worker loading `engine` does not pull in Ray's side.
"""
