"""LoRA adapters served by vLLM, trained by FSDP workers in Ray, and whole LoRA runs."""
