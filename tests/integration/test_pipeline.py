"""End-to-end runs of the asynchronous pipeline: real Ray, a real vLLM CPU engine, tiny models.

Each run goes through the `grpo` command line, exactly as a user launches it.
"""

from collections import defaultdict
from pathlib import Path

import pytest
import ray
from omegaconf import OmegaConf

from grpo.cli import main as grpo_main
from grpo.config import compose_config
from grpo.observability.metric_names import (
    EVAL_ACCURACY,
    GROUPS_KEPT,
    GROUPS_SCORED,
    INFERENCE_POLICY_VERSION,
    INFERENCE_TOKENS_PER_SECOND,
    METRIC_NAMES,
    REF_PERF_TIME_MODEL_RUNNING,
    REF_PERF_TIME_WAITING_BUFFER,
    REF_PERF_TOTAL_ROLLOUT_TIME,
    REF_PERF_TOTAL_TOKENS_PROCESSED,
    REPLAY_BUFFER_SIZE,
    REWARDS_FUNC_MEAN_TEMPLATE,
    REWARDS_MEAN,
    ROLLOUT_QUEUE_SIZE,
    SUCCESSES_MEAN,
    TRAIN_APPROX_POLICY_KLS,
    TRAIN_KL_LOSS,
    TRAIN_LOSS,
    TRAIN_PERF_PADDED_TOKENS_PERCENTAGE,
    TRAIN_PERF_STEP_WALL_TIME,
    TRAIN_PERF_TIME_GENERATION_BUSY,
    TRAIN_PERF_TIME_GRPO_STEPS,
    TRAIN_PERF_TIME_SCORING_BUSY,
    TRAIN_PERF_TIME_WAITING_BUFFER,
    TRAIN_PERF_TIME_WEIGHT_GATHER,
    TRAIN_PERF_TIME_WEIGHT_SYNC,
    TRAIN_PERF_TOKENS_PER_SECOND,
    TRAIN_PERF_TOTAL_STEP_TIME,
    TRAIN_RESPONSE_LENGTHS,
    ZERO_VARIANCE_GROUPS,
)
from grpo.observability.metrics import WALL_PARTS
from grpo.testing import RANDOM_MODEL_OVERRIDES, read_jsonl

pytestmark = pytest.mark.slow


def metric_series(run_dir: Path, key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in read_jsonl(run_dir / "metrics.jsonl") if key in r]


def run_cli(config: str, overrides: list[str]) -> None:
    assert grpo_main(["run", "async_grpo", "--config", config, *overrides]) == 0


def test_end_to_end_run(tiny_model_dir, tmp_path, monkeypatch, ray_shared):
    """A whole asynchronous run, with evaluation, a KL term, debug tables and dynamic sampling
    (ref.filter_zero_variance_groups): every step trains on ``batch_size`` unique trajectories
    from groups with differing rewards, and the counts add up. (One run serves both: the filter
    run of tests/integration/test_dynamic_sampling.py would pay another start-up.)"""
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    num_steps, batch_size, group_size = 4, 32, 4
    run_cli(
        "tiny_arithmetic_cpu",
        [
            f"base_model_path={tiny_model_dir}",
            *RANDOM_MODEL_OVERRIDES,
            f"output_dir={run_dir}",
            f"orchestration.num_steps={num_steps}",
            "eval_every_n_steps=2",
            "eval_num_examples=8",
            # Every trained sample is in the debug tables: the filter's checks below read them.
            "debug_logging_enabled=true",
            f"debug_num_samples_per_step={batch_size}",
            "inference.batch_size=8",
            f"inference.group_size={group_size}",
            "inference.max_generated_tokens=8",
            f"training.batch_size={batch_size}",
            # Dynamic sampling. The random tiny model emits a '7' sometimes: some groups' rewards
            # vary, many do not; it earns neither of the task's rewards, whose metrics are logged.
            "ref.filter_zero_variance_groups=true",
            "reward_functions=[{_component_: grpo.rewards.MathCorrectnessReward}, "
            "{_component_: grpo.rewards.FormatReward, think_required: false}, "
            "{_component_: grpo.rewards.TokenPresenceReward, token: '7'}]",
            # A KL term: the reference model is loaded and its logprobs reach the loss.
            "training.loss.kl_coeff=0.01",
        ],
    )

    # Every trained sequence is unique and was generated and scored before.
    trained = read_jsonl(run_dir / "trained.jsonl")
    scored = {
        sid for record in read_jsonl(run_dir / "scored.jsonl") for sid in record["sequence_ids"]
    }
    trained_ids = [sid for record in trained for sid in record["sequence_ids"]]
    cfg = OmegaConf.load(run_dir / "config.yaml")  # the config the run used
    assert [record["step"] for record in trained] == list(range(1, num_steps + 1))
    assert len(trained_ids) == num_steps * cfg.training.batch_size
    assert len(set(trained_ids)) == len(trained_ids), "a trajectory was trained on twice"
    assert set(trained_ids) <= scored, "trained on a sequence that was never generated"

    # Dynamic sampling: full batches, from scored groups the filter kept (it dropped some).
    scored_records = read_jsonl(run_dir / "scored.jsonl")
    dropped = {sid for r in scored_records for sid in r["dropped_sequence_ids"]}
    assert [len(r["sequence_ids"]) for r in trained] == [batch_size] * num_steps
    assert set(trained_ids) <= scored - dropped
    assert dropped, "no group had equal rewards: the filter was not exercised"
    # Every trained group is whole and its rewards differ (from the debug table's rows; the
    # reward is the sum of the functions', weights null).
    group_of = {sid: g for r in trained for sid, g in zip(r["sequence_ids"], r["group_ids"])}
    group_rewards: dict[int, list[float]] = defaultdict(list)
    for table in read_jsonl(run_dir / "tables" / "per_sample_debug_table.jsonl"):
        columns = table["columns"]
        reward_columns = [i for i, name in enumerate(columns) if name.startswith("Reward_")]
        assert len(reward_columns) == 3, columns
        for row in table["rows"]:
            sid = row[columns.index("Sequence ID")]
            group_rewards[group_of[sid]].append(sum(row[i] for i in reward_columns))
    assert sum(len(r) for r in group_rewards.values()) == num_steps * batch_size
    for group_id, values in group_rewards.items():
        assert len(values) == group_size and len(set(values)) > 1, (group_id, values)
    # The per-step counts add up to what scored.jsonl holds, up to the calls that finished
    # after the last step.
    counts = [r for r in read_jsonl(run_dir / "metrics.jsonl") if ZERO_VARIANCE_GROUPS in r]
    assert [r["step"] for r in counts] == list(range(1, num_steps + 1))
    assert all(r[GROUPS_KEPT] == r[GROUPS_SCORED] - r[ZERO_VARIANCE_GROUPS] for r in counts)
    logged_dropped = sum(r[ZERO_VARIANCE_GROUPS] for r in counts)
    assert 0 < logged_dropped <= len(dropped) // group_size
    assert sum(r[GROUPS_SCORED] for r in counts) <= len(scored) // group_size

    # Policy versions advance (one weight sync per step) and collectors pick them up.
    versions = metric_series(run_dir, "training/policy_version")
    assert [v for _, v in versions] == [float(s) for s in range(num_steps)]
    assert max(v for _, v in metric_series(run_dir, INFERENCE_POLICY_VERSION)) >= 1
    assert max(max(r["policy_versions"]) for r in trained) >= 1

    # The collector computes with exactly the trainer's weights after the last sync.
    assert metric_series(run_dir, "weight_sync/in_sync") == [(num_steps, 1.0)]

    # The metric log carries the trainer and reference metrics, rewards per function, evals.
    logged = set().union(*(r.keys() for r in read_jsonl(run_dir / "metrics.jsonl")))
    expected = [
        TRAIN_LOSS,
        "training/policy_loss",
        TRAIN_KL_LOSS,
        "training/ratios",
        "training/clipfrac",
        TRAIN_APPROX_POLICY_KLS,
        TRAIN_RESPONSE_LENGTHS,
        TRAIN_PERF_TOTAL_STEP_TIME,
        TRAIN_PERF_TIME_GRPO_STEPS,
        TRAIN_PERF_TOKENS_PER_SECOND,
        TRAIN_PERF_TIME_WEIGHT_SYNC,
        TRAIN_PERF_PADDED_TOKENS_PERCENTAGE,
        TRAIN_PERF_TIME_WAITING_BUFFER,
        "training_perf/pct_time_waiting_buffer (%)",
        TRAIN_PERF_TIME_WEIGHT_GATHER,
        REPLAY_BUFFER_SIZE,
        ROLLOUT_QUEUE_SIZE,
        REF_PERF_TOTAL_ROLLOUT_TIME,
        REF_PERF_TIME_MODEL_RUNNING,
        REF_PERF_TIME_WAITING_BUFFER,
        REF_PERF_TOTAL_TOKENS_PROCESSED,
        REWARDS_MEAN,
        SUCCESSES_MEAN,
        REWARDS_FUNC_MEAN_TEMPLATE.format(name="math_correctness"),
        REWARDS_FUNC_MEAN_TEMPLATE.format(name="format"),
        INFERENCE_TOKENS_PER_SECOND,
        EVAL_ACCURACY,
    ]
    missing = [key for key in expected if key not in logged]
    assert not missing, f"metrics.jsonl lacks {missing}"
    assert all(key in logged for key in METRIC_NAMES["training"][:6])

    # Every step's wall time is split into parts that add up to it.
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if TRAIN_PERF_STEP_WALL_TIME in r]
    assert [r["step"] for r in steps] == list(range(1, num_steps + 1))
    for record in steps:
        parts = [record[key] for key in WALL_PARTS]
        assert all(part >= 0.0 for part in parts), record
        assert sum(parts) == pytest.approx(record[TRAIN_PERF_STEP_WALL_TIME])
        assert (
            record[TRAIN_PERF_TIME_GENERATION_BUSY] >= 0.0
            and record[TRAIN_PERF_TIME_SCORING_BUSY] >= 0.0
        )
    eval_steps = [step for step, _ in metric_series(run_dir, EVAL_ACCURACY)]
    assert eval_steps == [0, 2, 4]

    # Debug tables hold the sequences that were trained, with all three kinds of logprobs.
    samples = read_jsonl(run_dir / "tables" / "per_sample_debug_table.jsonl")
    tokens = read_jsonl(run_dir / "tables" / "per_token_debug_table.jsonl")
    assert len(samples) == num_steps and len(tokens) == num_steps
    first = samples[0]
    columns = first["columns"]
    assert "Sequence ID" in columns and "Reward_math_correctness" in columns
    assert {row[columns.index("Sequence ID")] for row in first["rows"]} <= set(trained_ids)
    token_columns = tokens[0]["columns"]
    for name in ("Generated Logprob", "Ref Logprob", "Pi Logprob"):
        values = [row[token_columns.index(name)] for row in tokens[0]["rows"]]
        assert values and all(v <= 0.0 for v in values)
    # (The random model earns no reward here, so the policy never moves from the reference.)
    kl_to_ref = [v for _, v in metric_series(run_dir, "training/kl_to_ref")]
    assert len(kl_to_ref) == num_steps and all(v >= 0.0 for v in kl_to_ref)

    # Plots were written.
    assert (run_dir / "plots" / "eval_accuracy.png").stat().st_size > 1000

    # The final checkpoint loads in vLLM and generates.
    from vllm import LLM, SamplingParams

    from grpo.testing import set_vllm_cpu_env, tiny_vllm_engine_kwargs

    ray.shutdown()
    set_vllm_cpu_env()
    llm = LLM(model=str(run_dir / "final"), **tiny_vllm_engine_kwargs())
    output = llm.generate(["What is 2 + 3?\n"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(output[0].outputs[0].token_ids) >= 1


def test_learning_signal_on_a_toy_reward(tiny_model_dir, tmp_path, monkeypatch, ray_shared):
    """A reward a random model earns sometimes rises well beyond noise in 30 steps."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    cfg = compose_config("tiny_arithmetic_cpu", list(RANDOM_MODEL_OVERRIDES))
    cfg.base_model_path = str(tiny_model_dir)
    cfg.output_dir = str(tmp_path / "run")
    cfg.orchestration.num_steps = 30
    cfg.eval_every_n_steps = None
    cfg.inference.max_generated_tokens = 8
    cfg.inference.batch_size = 4
    cfg.training.batch_size = 32
    cfg.training.optimizer.lr = 2e-3
    cfg.reward_functions = [{"_component_": "grpo.rewards.TokenPresenceReward", "token": "7"}]
    config_path = tmp_path / "toy.yaml"
    OmegaConf.save(cfg, config_path)
    run_cli(str(config_path), [])

    rewards = [v for _, v in metric_series(Path(cfg.output_dir), REWARDS_MEAN)]
    assert len(rewards) >= 20
    first, last = rewards[:5], rewards[-5:]
    start, end = sum(first) / len(first), sum(last) / len(last)
    assert start < 0.6, f"the toy reward is already easy at the start ({start:.2f})"
    assert end > start + 0.25, f"reward did not rise: {start:.2f} -> {end:.2f} ({rewards})"
