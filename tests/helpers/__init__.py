"""Helpers that only the tests use: tiny models with a real family's chat template
(`chat_families`) and the plain full-logits logprobs the chunked ones are checked against
(`logprobs`). What must import inside Ray workers or in scripts stays in `grpo.testing`.
"""
