"""Packed-sequence compute in pure torch: packing (`packs`), the pack's attention (`attention`)
and the response tokens' logprobs (`logprobs`), shared by the reference actor and the trainer.
"""
