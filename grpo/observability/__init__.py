"""What a run shows and records, in one package.

* `console`: the terminal: a few start lines, one progress bar, the results.
* `logs`: each process's own output to ``output_dir/logs/`` (`DriverLog`, `with_output_to`).
* `metric_names`: the metric-name contract between the actors, the logger, the plots and the
  tests.
* `metric_logger`: `MetricLogger`, the Ray actor that writes ``metrics.jsonl`` and W&B.
* `metrics`: the driver's step metrics, the run ledger (which sequences were scored and
  trained) and the debug tables.
* `plotting`: PNG plots of a run's metrics.

Import the modules directly (``from grpo.observability.console import print_start``): this
package imports nothing, so the command line loads only what it uses.
"""
