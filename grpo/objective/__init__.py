"""The objective: group advantages and the GRPO loss on packed batches (pure torch)."""
