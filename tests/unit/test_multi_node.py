"""Several Ray nodes on one machine (`ray.cluster_utils.Cluster`): roles placed on their nodes
by custom resources, a run that joins the cluster through ``ray.address``, and placements no
node can host refused before any actor starts.

The tests that start a Ray cluster or a vLLM engine: tests/integration/test_multi_node.py.
"""

from __future__ import annotations

from grpo.orchestrator.supervisor import placement_problems

# ------------------------------------------------------------------------ the check, alone

TRAINER = ("training", "num_training_workers")


def test_a_resource_no_node_has_is_named_with_the_nodes():
    nodes = [{"CPU": 2.0, "rollout_node": 1.0, "node:10.0.0.1": 1.0}, {"CPU": 4.0}]
    (problem,) = placement_problems(nodes, [(*TRAINER, 1, {"CPU": 1.0, "learner": 1.0})])
    assert problem.startswith("training.resources: each training actor needs {CPU: 1, learner: 1}")
    assert "no node of the Ray cluster has learner" in problem
    assert "(nodes: {CPU: 2, rollout_node: 1}; {CPU: 4})" in problem  # node:<ip> left out
    (gpu,) = placement_problems(nodes, [(*TRAINER, 1, {"CPU": 1.0, "GPU": 1.0})])
    assert gpu.startswith("training.num_gpus: ") and "has GPU" in gpu


def test_actors_that_fit_only_on_too_few_nodes_are_counted():
    nodes = [{"CPU": 2.0, "learner": 1.0}, {"CPU": 2.0, "learner": 1.0}, {"CPU": 8.0}]
    demand = {"CPU": 1.0, "learner": 1.0}
    assert placement_problems(nodes, [(*TRAINER, 2, demand)]) == []
    (problem,) = placement_problems(nodes, [(*TRAINER, 3, demand)])
    assert problem.startswith("orchestration.num_training_workers: 3 training actors need")
    assert "the Ray cluster's nodes fit 2" in problem
    # 0.5 CPU each: four fit on a 2-CPU node.
    assert placement_problems([{"CPU": 2.0}], [(*TRAINER, 4, {"CPU": 0.5})]) == []
    assert placement_problems([{"CPU": 2.0}], [(*TRAINER, 0, {"CPU": 9.0})]) == []


# ------------------------------------------------------------------- a cluster of 2 nodes


PLACED = (
    "inference.resources={rollout_node: 1}",
    "ref.resources={learner_node: 1}",
    "training.resources={learner_node: 1}",
)
