"""The metric logger: one sink for every actor's metrics, on disk and on W&B.

Every actor sends its metrics to one `MetricLogger` (a Ray actor), which appends them to
``metrics.jsonl`` (flushed at every write) and, when asked, to W&B.

The actors do not share a clock, and W&B drops a ``log(step=s)`` below a step already logged,
so the logger never passes ``step=``: each namespace gets its own step metric
(``define_metric``), sent with every call. A resume logs to the same W&B run (its id is kept
in the run folder); a rewind forks it, since a W&B history can only grow (docs/reliability.md).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import math
import os
import re
import time
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from grpo.choices import WANDB_MODES
from grpo.config.options import checked_options
from grpo.config.sections import StdoutEveryN
from grpo.observability.metric_names import (
    EVAL_ACCURACY,
    GLOBAL_STEP,
    INFERENCE_STEP,
    INFERENCE_TOKENS_PER_SECOND,
    REF_STEP,
    RESERVED_KEYS,
    REWARDS_MEAN,
    STEP_METRIC_RULES,
    SUCCESSES_MEAN,
    TRAIN_KL_LOSS,
    TRAIN_LOSS,
    TRAIN_PERF_TOKENS_PER_SECOND,
    TRAIN_POLICY_AGE_MEAN,
    TRAINING_STEP,
    rule_for,
    step_metric_for,
)
from grpo.observability.metrics import records_after_rewinds
from grpo.run_folder import WANDB_RUN_FILE

log = logging.getLogger(__name__)

# What stdout shows when `stdout_keys` is not given: a few headline numbers per actor.
DEFAULT_STDOUT_KEYS: tuple[str, ...] = (
    TRAIN_LOSS,
    TRAIN_KL_LOSS,
    TRAIN_POLICY_AGE_MEAN,
    TRAIN_PERF_TOKENS_PER_SECOND,
    REWARDS_MEAN,
    SUCCESSES_MEAN,
    INFERENCE_TOKENS_PER_SECOND,
    EVAL_ACCURACY,
)

_TABLE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def resolve_wandb_mode(mode: str) -> str:
    """W&B mode: ``WANDB_MODE`` in the environment wins over the config (tests, CI)."""
    env_mode = os.environ.get("WANDB_MODE")
    if env_mode:
        mode = "offline" if env_mode == "dryrun" else env_mode
    if mode not in WANDB_MODES:
        raise ValueError(f"W&B mode must be one of {WANDB_MODES}, got {mode!r}")
    return mode


def _to_jsonable(value: Any) -> Any:
    """Config values -> JSON/YAML-safe containers (Paths and other objects become strings)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
    except ImportError:
        pass
    if isinstance(value, Mapping):
        return {str(k): _to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_to_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def saved_wandb_run(log_dir: str | Path, project: str) -> dict[str, Any] | None:
    """The W&B run an earlier logger of ``log_dir`` logged to, which a new one resumes.

    Args:
        project: The W&B project; a saved run of another project is ignored.

    Returns:
        dict[str, Any] | None: ``id``, ``name``, ``project`` and ``first_record_offset``
        (where the W&B run's records begin in ``metrics.jsonl``); None when there is none.
    """
    path = Path(log_dir).expanduser() / WANDB_RUN_FILE
    try:
        saved = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError) as error:
        log.warning("ignoring %s (%s): a new W&B run is started", path, error)
        return None
    if not isinstance(saved, dict) or not isinstance(saved.get("id"), str):
        return None
    return saved if saved.get("project") == project else None


# The metric logger a run uses unless its config names another class.
DEFAULT_METRIC_LOGGER = "grpo.observability.metric_logger.MetricLogger"


class MetricLogger:
    """Writes metrics to ``metrics.jsonl`` (always), W&B (optional) and stdout (a few keys).

    Writes to `log_dir`: ``metrics.jsonl`` (one ``{"step", "time", "actor"?, **metrics}``
    per call, non-finite values as ``null``), ``tables/*.jsonl``, ``summary.json``, the run
    config (``config.yaml``, ``config.json``) and the W&B run's id (``wandb_run.json``).

    Args:
        mode: W&B mode, ``"online"``, ``"offline"`` or ``"disabled"``; ``WANDB_MODE``
            overrides it.
        config: Run config, for W&B and the config files (an OmegaConf config is resolved).
        stdout_every_n: Print every n-th step of each actor to stdout; 0 prints nothing.
        stdout_keys: Metric names or globs printed to stdout (`DEFAULT_STDOUT_KEYS` if None).
        use_wandb: Log to W&B too. A W&B failure is reported once, then W&B stays off and
            logging goes on to JSONL and stdout.

    Raises:
        ValueError: On an unknown W&B mode or a negative `stdout_every_n`.
    """

    @checked_options  # the bound the config declares for stdout_every_n
    def __init__(
        self,
        log_dir: str | Path,
        project: str = "grpo",
        run_name: str | None = None,
        mode: str = "online",
        config: Mapping[str, Any] | None = None,
        stdout_every_n: StdoutEveryN = 1,
        stdout_keys: Collection[str] | None = None,
        use_wandb: bool = True,
    ) -> None:
        self.log_dir = Path(log_dir).expanduser().resolve()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.stdout_every_n = stdout_every_n
        self.stdout_keys = tuple(DEFAULT_STDOUT_KEYS if stdout_keys is None else stdout_keys)
        self.mode = resolve_wandb_mode(mode) if use_wandb else "disabled"
        self._project = project

        self._log_path = self.log_dir / "metrics.jsonl"
        # Line-buffered append; `_write_line` flushes explicitly as well.
        self._file = open(self._log_path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        # What a W&B run forked at a rewind gets again; a resumed W&B run keeps its saved one.
        self._first_record_offset = self._log_path.stat().st_size
        self._table_files: dict[str, Any] = {}
        summary_path = self.log_dir / "summary.json"
        self._summary: dict[str, Any] = (
            json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        )
        self._nonfinite_counts: Counter[str] = Counter()
        self._closed = False

        self.config = _to_jsonable(config) if config is not None else None
        if self.config is not None:
            self._write_config(self.config)

        self._wandb = None  # the wandb module, once imported
        self._wandb_run = None
        self._wandb_defined: set[str] = set()
        if self.mode != "disabled":
            self._init_wandb(project, run_name, resume=saved_wandb_run(self.log_dir, project))

    def log_dict(self, metrics: Mapping[str, Any], step: int, actor: str | None = None) -> None:
        """Log one step's metrics.

        Args:
            metrics: Metric name -> number (or one-element tensor), string or None.
            actor: Who logs (``"training"``, ``"ref"``, ``"inference"``, ``"eval"``, ...); picks
                the W&B step metric of keys outside `STEP_METRIC_RULES`.

        Raises:
            RuntimeError: If the logger is closed.
            TypeError: If `step` is not an int or a value is not a scalar.
            ValueError: If a key is ``step``, ``time`` or ``actor``.
        """
        self._check_open()
        step = _check_step(step)
        record: dict[str, Any] = {"step": step, "time": time.time()}
        if actor is not None:
            record["actor"] = str(actor)
        for key, value in metrics.items():
            if not isinstance(key, str):
                raise TypeError(f"metric names must be str, got {key!r} ({type(key).__name__})")
            if key in RESERVED_KEYS:
                raise ValueError(
                    f"metric name {key!r} is reserved for the record itself "
                    f"({sorted(RESERVED_KEYS)}); rename it"
                )
            record[key] = self._json_value(key, _scalar(key, value), step)
        self._write_line(self._file, record)

        if self._wandb_run is not None:
            wandb_metrics = {key: _scalar(key, value) for key, value in metrics.items()}
            self._wandb_log(wandb_metrics, step, actor)
        self._print(record, step, actor)

    def log_table(
        self,
        rows: Sequence[Sequence[Any]],
        columns: Sequence[str],
        table_name: str,
        step: int,
        actor: str | None = None,
    ) -> None:
        """Log a table (e.g. per-sample debug rows): W&B table + ``tables/{table_name}.jsonl``.

        Args:
            columns: Column names; every row has this many cells.
            table_name: Letters, digits, ``_``, ``.``, ``-``.

        Raises:
            RuntimeError: If the logger is closed.
            ValueError: On a bad table name or a row of the wrong length.
        """
        self._check_open()
        step = _check_step(step)
        if not _TABLE_NAME.match(table_name):
            raise ValueError(
                f"table name {table_name!r} must match {_TABLE_NAME.pattern} "
                "(it names a file under tables/)"
            )
        columns = [str(c) for c in columns]
        rows = [list(row) for row in rows]
        for index, row in enumerate(rows):
            if len(row) != len(columns):
                raise ValueError(
                    f"table {table_name!r}: row {index} has {len(row)} cells, "
                    f"expected {len(columns)} (columns {columns})"
                )
        count_key = f"table/{table_name}"
        record = {
            "step": step,
            "time": time.time(),
            **({"actor": str(actor)} if actor is not None else {}),
            "columns": columns,
            "rows": [[self._json_cell(count_key, cell, step) for cell in row] for row in rows],
        }
        if table_name not in self._table_files:
            (self.log_dir / "tables").mkdir(exist_ok=True)
            path = self.log_dir / "tables" / f"{table_name}.jsonl"
            self._table_files[table_name] = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self._write_line(self._table_files[table_name], record)

        if self._wandb_run is not None:
            try:
                table = self._wandb.Table(columns=columns, data=record["rows"])
            except Exception as error:  # noqa: BLE001 - W&B must never stop training
                self._wandb_failed(f"building table {table_name!r}", error)
            else:
                self._wandb_log({table_name: table}, step, actor)

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """Record run-level results (final accuracy, totals): ``summary.json`` and W&B summary.

        ``summary`` maps names to JSON-able values, merged with earlier calls.

        Raises:
            RuntimeError: If the logger is closed.
        """
        self._check_open()
        for key, value in summary.items():
            self._summary[str(key)] = self._json_cell(str(key), _to_jsonable(_unwrap(value)), None)
        self._write_summary()
        if self._wandb_run is not None:
            try:
                self._wandb_run.summary.update({k: _unwrap(v) for k, v in summary.items()})
            except Exception as error:  # noqa: BLE001
                self._wandb_failed("updating the summary", error)

    def rewound(self, step: int, from_step: int) -> None:
        """Mark that the run went back to its checkpoint of ``step``; steps after it are redone.

        ``metrics.jsonl`` gets a ``rewound_to`` line (superseded records stay, and
        `records_after_rewinds` skips them); the W&B run is forked.

        Args:
            step: The step of the checkpoint the run went back to (0: the start).

        Raises:
            RuntimeError: If the logger is closed.
        """
        self._check_open()
        step = _check_step(step)
        record = {"step": step, "time": time.time(), "rewound_to": step, "from_step": from_step}
        self._write_line(self._file, record)
        if self._wandb_run is not None:
            self._fork_wandb_run(step, from_step)

    def resumed(self, step: int) -> None:
        """Mark that a resumed run goes on from its checkpoint of ``step``.

        Steps logged after that checkpoint are redone: a rewind (`rewound`).

        Raises:
            RuntimeError: If the logger is closed.
        """
        self._check_open()
        with open(self._log_path, encoding="utf-8") as file:
            records = [json.loads(line) for line in file if line.strip()]
        last = max((record["step"] for record in records_after_rewinds(records)), default=0)
        if last > step:
            self.rewound(step, from_step=last)

    def get_log_path(self) -> Path:
        """The ``metrics.jsonl`` this logger writes."""
        return self._log_path

    def get_nonfinite_counts(self) -> dict[str, int]:
        """How many NaN/inf values each metric (or ``table/{name}``) had, written as null."""
        return dict(self._nonfinite_counts)

    def close(self) -> None:
        """Finish the W&B run and close the files. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self._nonfinite_counts:
            self._summary["logger/nonfinite_values"] = sum(self._nonfinite_counts.values())
            self._write_summary()
        if self._wandb_run is not None:
            try:
                self._wandb_run.finish()
            except Exception as error:  # noqa: BLE001
                self._wandb_failed("finishing the run", error)
            self._wandb_run = None
        self._file.close()
        for table_file in self._table_files.values():
            table_file.close()

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"MetricLogger for {self._log_path} is closed")

    @staticmethod
    def _write_line(file: Any, record: dict[str, Any]) -> None:
        # allow_nan=False: a NaN that slipped past the sanitiser fails here, not in a reader.
        file.write(json.dumps(record, allow_nan=False) + "\n")
        file.flush()

    def _write_config(self, config: dict[str, Any]) -> None:
        import yaml

        (self.log_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (self.log_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))

    def _write_summary(self) -> None:
        # Write-then-rename so a reader never sees half a file.
        path = self.log_dir / "summary.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self._summary, indent=2, allow_nan=False) + "\n")
        tmp.replace(path)

    def _json_value(self, key: str, value: Any, step: int | None) -> Any:
        """A metric value for JSON: non-finite floats become None and are counted."""
        if isinstance(value, float) and not math.isfinite(value):
            if self._nonfinite_counts[key] == 0:
                log.warning("metric %r is %s at step %s: written as null", key, value, step)
            self._nonfinite_counts[key] += 1
            return None
        return value

    def _json_cell(self, key: str, value: Any, step: int | None) -> Any:
        """Like `_json_value` for table cells and summary values, which may be nested."""
        value = _unwrap(value)
        if callable(getattr(value, "tolist", None)):  # multi-element tensors and arrays
            value = value.tolist()
        if isinstance(value, (list, tuple)):
            return [self._json_cell(key, v, step) for v in value]
        if isinstance(value, Mapping):
            return {str(k): self._json_cell(key, v, step) for k, v in value.items()}
        if isinstance(value, float):
            return self._json_value(key, value, step)
        if value is None or isinstance(value, (bool, int, str)):
            return value
        return str(value)

    def _print(self, record: dict[str, Any], step: int, actor: str | None) -> None:
        if self.stdout_every_n == 0 or step % self.stdout_every_n != 0:
            return
        shown = [
            (key, value)
            for key, value in record.items()
            if key not in RESERVED_KEYS
            and any(fnmatch.fnmatchcase(key, pattern) for pattern in self.stdout_keys)
        ]
        if not shown:
            return
        parts = [f"{key.rsplit('/', 1)[-1]}={_format_number(value)}" for key, value in shown]
        print(f"[{actor or 'step'} {step}] " + " ".join(parts), flush=True)

    def _init_wandb(
        self,
        project: str,
        run_name: str | None,
        notes: str | None = None,
        resume: dict[str, Any] | None = None,
    ) -> None:
        try:
            import wandb
        except ImportError as error:
            self._wandb_failed("importing wandb", error)
            return
        options: dict[str, Any] = {}
        if resume is not None:
            # "allow", not "must": a run that was logged offline and never synced is not on
            # the server yet, and is made there with this id.
            options = {"id": resume["id"], "resume": "allow"}
            run_name = resume.get("name") or run_name  # a forked run keeps its "(from step N)"
            self._first_record_offset = int(resume.get("first_record_offset", 0))
        try:
            run = wandb.init(
                project=project,
                name=run_name,
                notes=notes,
                config=self.config,
                mode=self.mode,
                dir=str(self.log_dir),
                # Each logger owns its run, even when a process holds more than one.
                reinit="create_new",
                **options,
            )
            for step_metric in (TRAINING_STEP, REF_STEP, INFERENCE_STEP, GLOBAL_STEP):
                run.define_metric(step_metric, hidden=True)
            for pattern, step_metric in STEP_METRIC_RULES:
                run.define_metric(pattern, step_metric=step_metric)
        except Exception as error:  # noqa: BLE001 - no network, bad key, ...: keep logging
            self._wandb_failed(f"starting the run (project {project!r}, mode {self.mode!r})", error)
            return
        self._wandb = wandb
        self._wandb_run = run
        self._save_wandb_run(project, run_name)
        resumed = "resumed" if resume is not None else "new"
        log.info("W&B run %s (%s, %s) in %s", run.name, resumed, self.mode, self.log_dir / "wandb")

    def _save_wandb_run(self, project: str, run_name: str | None) -> None:
        """Keep the W&B run's id in the folder for a resume (`WANDB_RUN_FILE`)."""
        run = self._wandb_run
        if not isinstance(getattr(run, "id", None), str):
            return
        saved = {
            "id": run.id,
            # Offline, W&B knows no name for a run it was not given one.
            "name": run.name or run_name,
            "project": project,
            "first_record_offset": self._first_record_offset,
        }
        path = self.log_dir / WANDB_RUN_FILE
        tmp = path.with_suffix(".json.tmp")
        try:
            tmp.write_text(json.dumps(saved, indent=2) + "\n")
            tmp.replace(path)
        except (OSError, TypeError) as error:  # a resume then starts a new W&B run
            log.warning("could not write %s: %s", path, error)

    def _wandb_log(self, metrics: dict[str, Any], step: int, actor: str | None) -> None:
        payload = dict(metrics)
        try:
            for key in metrics:
                step_metric = step_metric_for(key, actor)
                # W&B needs the x value in the same call; a call can carry two step metrics
                # (e.g. a key routed to training_step logged by the ref actor), both = `step`.
                payload.setdefault(step_metric, step)
                if rule_for(key) is None and key not in self._wandb_defined:
                    self._wandb_run.define_metric(key, step_metric=step_metric)
                    self._wandb_defined.add(key)
            self._wandb_run.log(payload)
        except Exception as error:  # noqa: BLE001
            self._wandb_failed(f"logging step {step}", error)

    def _fork_wandb_run(self, step: int, from_step: int) -> None:
        """Finish the W&B run and go on in a new one given the standing records again.

        W&B's own rewind (``resume_from``) needs its server and does not take the
        per-namespace step metrics. Tables logged before the rewind stay in the first run.
        """
        old = self._wandb_run
        old_id = getattr(old, "id", None)
        try:
            old.summary.update({"rewound_to_step": step, "from_step": from_step})
            old.finish()
        except Exception as error:  # noqa: BLE001 - W&B must never stop training
            self._wandb_failed("finishing the run that a rewind supersedes", error)
            return
        self._wandb_run = None
        self._wandb_defined = set()
        self._init_wandb(
            self._project,
            f"{old.name} (from step {step})",
            notes=f"Continues W&B run {old_id} after a trainer restart went back to step "
            f"{step}; that run also holds the first, superseded values of steps "
            f"{step + 1} to {from_step}.",
        )
        if self._wandb_run is None:
            return
        with open(self._log_path, encoding="utf-8") as file:
            file.seek(self._first_record_offset)
            records = [json.loads(line) for line in file if line.strip()]
        for record in records_after_rewinds(records):
            metrics = {
                key: value
                for key, value in record.items()
                # A null was a non-finite value or a None: W&B gets nothing for it.
                if key not in RESERVED_KEYS and value is not None
            }
            if metrics:
                self._wandb_log(metrics, record["step"], record.get("actor"))
        if self._summary and self._wandb_run is not None:
            try:
                self._wandb_run.summary.update(self._summary)
            except Exception as error:  # noqa: BLE001
                self._wandb_failed("updating the summary", error)

    def _wandb_failed(self, what: str, error: BaseException) -> None:
        """Report a W&B failure once and turn W&B off; JSONL and stdout carry on."""
        log.warning(
            "W&B failed while %s: %s: %s. W&B logging is off for the rest of this run; "
            "metrics still go to %s",
            what,
            type(error).__name__,
            error,
            self._log_path,
        )
        self._wandb_run = None


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(_unwrap(step), int):
        raise TypeError(f"step must be an int, got {step!r} ({type(step).__name__})")
    return int(_unwrap(step))


def _unwrap(value: Any) -> Any:
    """One-element tensors and numpy scalars -> Python numbers; anything else unchanged."""
    item = getattr(value, "item", None)
    if callable(item) and not isinstance(value, (bool, int, float, str)):
        size = getattr(value, "size", None)
        numel = value.numel() if hasattr(value, "numel") else (size if isinstance(size, int) else 1)
        if numel == 1:
            return item()
    return value


def _scalar(key: str, value: Any) -> Any:
    value = _unwrap(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(
        f"metric {key!r}: expected a number, a string or None, got {type(value).__name__} "
        f"{getattr(value, 'shape', '')}".rstrip()
    )


def _format_number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "nan" if value is None else str(value)
