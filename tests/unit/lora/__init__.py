"""LoRA adapters: the model, the trainer and the preflight checks, without Ray or vLLM."""
