"""Tests that start a Ray cluster or a vLLM engine: components in actors, and whole runs."""
