"""Weight sync: the trainer's weights into the collectors' vLLM engines, verified.

`sync.WeightSync` drives it; `base` defines a transport's two ends and `transports` picks one.
Import the modules directly: this package imports nothing, so the vLLM worker loading `engine`
does not pull in Ray's side.
"""
