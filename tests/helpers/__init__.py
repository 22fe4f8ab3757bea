"""Helpers that only the tests use: tiny models with a real family's chat template
(`chat_families`), the plain full-logits logprobs the chunked ones are checked against
(`logprobs`), the bit-for-bit comparison of two trainers' states (`training_state`), the reward
functions the reward pool's tests run in worker processes (`rewards`, free of torch), and a file
of ``scripts/`` imported as a module (`scripts`). What must import inside Ray workers or in
scripts stays in `grpo.testing`.
"""
