"""Tests that start no Ray cluster and no vLLM engine: seconds on a laptop CPU."""
