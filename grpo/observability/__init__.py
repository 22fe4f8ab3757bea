"""What a run shows and records: the terminal (`console`), log files (`logs`), metric names
(`metric_names`), the metrics writer (`metric_logger`), step metrics (`metrics`) and plots
(`plotting`). This package imports nothing, so the command line loads only what it uses.
"""
