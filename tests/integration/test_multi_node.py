"""Several Ray nodes on one machine (placement and lost nodes): the tests that start a Ray
cluster or a vLLM engine.

The tests without either: tests/unit/test_multi_node.py.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import ray

from grpo.cli import main as grpo_main
from grpo.observability.metrics import records_after_rewinds
from grpo.orchestrator import Role
from grpo.testing import RANDOM_MODEL_OVERRIDES, read_jsonl, start_tiny_run
from tests.unit.test_multi_node import PLACED


@pytest.fixture(scope="module")
def cluster():
    """A head node (the driver, the queue, buffer and metric logger), two generation nodes and
    two nodes for the reference actor and trainer."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    rollout_nodes = [cluster.add_node(num_cpus=1, resources={"rollout_node": 1}) for _ in "ab"]
    learners = [cluster.add_node(num_cpus=2, resources={"learner_node": 2}) for _ in "ab"]
    cluster.wait_for_nodes()
    yield cluster, rollout_nodes, learners
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


def node_of(actor) -> str:
    actor = getattr(actor, "actor", actor)  # the rollout queue's own actor
    return ray.get(actor.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id()))


@pytest.mark.slow
def test_a_placement_no_node_can_host_is_refused_before_actors_start(
    cluster, tiny_model_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    cluster, _, _ = cluster
    run_dir = tmp_path / "run"
    status = grpo_main(
        [
            *("run", "async_grpo", "--config", "tiny_arithmetic_cpu"),
            f"base_model_path={tiny_model_dir}",
            *RANDOM_MODEL_OVERRIDES,
            f"output_dir={run_dir}",
            f"ray.address={cluster.address}",
            *PLACED[:2],
            "training.resources={gpu_node: 1}",
        ]
    )
    ray.shutdown()
    err = capsys.readouterr().err
    assert status == 2, err
    assert "training.resources: each training actor needs {CPU: 1, gpu_node: 1}" in err
    assert "no node of the Ray cluster has gpu_node" in err and "Traceback" not in err
    # No actor started: each writes its own log file in logs/ as it starts.
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["driver.log"]
    assert not (run_dir / "metrics.jsonl").exists()


@pytest.mark.slow
def test_roles_run_on_their_nodes_and_lost_nodes_lose_nothing(
    cluster, tiny_model_dir, tmp_path, monkeypatch
):
    """A run joins the cluster through ``ray.address``; each role starts on the nodes with its
    resource. Then the generation node dies mid-run (its raylet and every process on it, the
    collector's vLLM engine included): the collector is replaced on the other generation node.
    Later the trainer's node dies: the run restarts from its latest checkpoint with the
    trainer on the other learner node. The run finishes, no generated group is lost, none is
    trained twice in the steps that stand, and the checkpoints the trainer (on another node)
    writes land in the run folder."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    cluster, rollout_nodes, learners = cluster
    run_dir = tmp_path / "run"
    # Room after the second node loss (step 6): removing a node takes seconds, and a run that
    # had finished meanwhile would never see its trainer die.
    num_steps = 14
    run = start_tiny_run(
        tiny_model_dir,
        run_dir,
        num_steps,
        f"ray.address={cluster.address}",
        "orchestration.stall_timeout_s=120",
        "inference.max_generated_tokens=8",
        "inference.batch_size=4",
        "training.batch_size=32",
        "checkpoint.save_every_n_steps=2",
        *PLACED,
    )
    removed = []
    try:
        first = node_of(run.actors.actor(Role.INFERENCE))
        (doomed,) = [node for node in rollout_nodes if node.node_id == first]
        survivor = next(node.node_id for node in rollout_nodes if node is not doomed)
        learner_ids = {node.node_id for node in learners}
        assert node_of(run.actors.actor(Role.REF)) in learner_ids
        assert node_of(run.actors.actor(Role.TRAINING)) in learner_ids
        # The coordination actors stay on the driver's node, so no other node takes them along.
        driver_node = ray.get_runtime_context().get_node_id()
        for role in (Role.ROLLOUT_QUEUE, Role.REPLAY_BUFFER):
            assert node_of(run.actors.actor(role)) == driver_node, role

        def remove_nodes() -> None:
            for step in (3, 6):
                deadline = time.monotonic() + 300
                while run.state.step < step and time.monotonic() < deadline:
                    time.sleep(0.05)
                # The trainer's node goes only once the collector's loss is handled: Ray may
                # report the collector dead only after a few more steps (trained from the
                # buffer), and a trainer restart meanwhile would replace the collector with
                # everything else, leaving no recovery of its own to check.
                while (
                    step == 6
                    and not any(r.actor == "inference[0]" for r in run.recoveries)
                    and time.monotonic() < deadline
                ):
                    time.sleep(0.05)
                if step == 3:
                    node = doomed
                else:  # the trainer's node now (a restart may have moved it)
                    trainer_node = node_of(run.actors.actor(Role.TRAINING))
                    (node,) = [n for n in learners if n.node_id == trainer_node]
                cluster.remove_node(node, allow_graceful=False)
                removed.append(node)

        threading.Thread(target=remove_nodes, daemon=True).start()
        state = run.run()
        replacement = node_of(run.actors.actor(Role.INFERENCE))
        new_trainer_node = node_of(run.actors.actor(Role.TRAINING))
        saved = run.save_checkpoint()
    finally:
        run.shutdown()
        ray.shutdown()
    assert len(removed) == 2 and state.step == num_steps
    # The reference actor may have shared the trainer's node and been replaced first.
    recovered = [r.actor for r in run.recoveries]
    assert recovered[0] == "inference[0]" and recovered[-1] == "training[0]", recovered
    assert set(recovered) <= {"inference[0]", "ref[0]", "training[0]"}
    assert replacement == survivor
    assert new_trainer_node != removed[1].node_id and new_trainer_node in learner_ids
    scored = [
        sid
        for r in read_jsonl(run_dir / "scored.jsonl")
        if "sequence_ids" in r
        for sid in r["sequence_ids"]
    ]
    records = read_jsonl(run_dir / "trained.jsonl")
    # Rewound at least once, to a checkpoint (every 2 steps); the collector's catch-up after
    # the first node loss may also find the trainer dead (its gloo peer vanished mid-send).
    rewinds = [r["rewound_to"] for r in records if "rewound_to" in r]
    assert rewinds and all(step % 2 == 0 for step in rewinds), rewinds
    trained = [sid for r in records_after_rewinds(records) for sid in r["sequence_ids"]]
    numbers = sorted({int(sid.split("-")[1]) for sid in scored})
    assert numbers == list(range(numbers[-1] + 1)), "a generated group was lost"
    assert len(trained) == len(set(trained)) == num_steps * 32
    assert set(trained) <= set(scored)
    assert saved == run_dir / "checkpoints" / f"step_{num_steps:06d}"
    assert json.loads((saved / "state.json").read_text())["step"] == num_steps
    assert (saved / "model" / "model.safetensors").is_file()
