"""Ray actors of the pipeline. Import the modules directly: this package imports nothing, so
one actor never pulls in vLLM or Ray for another."""
