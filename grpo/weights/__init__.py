"""Weight sync: the trainer's weights into the collectors' vLLM engines, verified.

One package, one module per part:

* `base`: `WeightTransport`, the interface the driver sends through (gather, send, finish,
  forget); `transports`: the one place a transport is chosen (``weight_sync.transport``).
* `object_store`: the weights as one object in Ray's object store.
* `collective`: a two-rank process group per collector (`channel`: gloo on CPU, NCCL on GPU);
  its trainer side (`ChannelSender`) and collector side (`ChannelReceiver`).
* `engine`: the collector's vLLM side: the worker extension that reloads weights in place,
  and `WeightReceiver`, which applies the newest update between two engine steps or batches.
* `checksum`: one definition of "these weights" for both ends.
* `sync`: `WeightSync`, the driver: gather, send, catch up a replaced collector, verify.

Import the modules directly (``from grpo.weights.sync import WeightSync``): this package
imports nothing, so the vLLM worker loading `engine` does not pull in Ray's side.
"""
