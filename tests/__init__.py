"""The test suite: `unit/` starts no Ray cluster and no vLLM engine, `integration/` does."""
