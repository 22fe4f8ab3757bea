"""The objective: group advantages (`grpo.objective.advantages`) and the GRPO loss on packed
batches (`grpo.objective.loss`). Pure torch; the reference actor computes advantages, the
trainer the loss.
"""
