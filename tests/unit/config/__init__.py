"""The run config: loading, overrides, validation, instantiation, the shipped configs and the
reference."""
