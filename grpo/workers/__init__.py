"""Ray actors of the pipeline: collector (vLLM), reference, replay buffer, trainer, metrics.

Import the modules directly (``from grpo.workers.collector import SyncLLMCollector``); this
package imports nothing so that importing one actor never pulls in vLLM or Ray for another.
"""
