"""Packed-sequence compute: one batch of unpadded sequences, end to end, in pure torch.

- `grpo.packing.packs`: sequences -> `PackedTrajectory` (block-causal, shared prompts), the
  plan of packs under a token budget, the split of a batch over trainers.
- `grpo.packing.attention`: the pack's attention mask as a dense mask, a FlexAttention
  ``BlockMask`` or varlen offsets, and the hook that makes a model attend through it.
- `grpo.packing.logprobs`: the response tokens' logprobs of a pack, from hidden states
  projected in chunks (the ``[L, V]`` logits are never built).

The reference actor and the trainer both import these; neither re-implements them.
"""
