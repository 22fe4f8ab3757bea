"""Whether the actors of a run fit the local Ray cluster it would start.

The roles and their keys come from the one table of placed roles, `grpo.config.run.ROLES`.
"""

from __future__ import annotations

import os

from grpo.config.run import ROLES, value_at


def local_cluster_problems(values: dict, this_machine: bool = True) -> list[str]:
    """A local cluster must have room for every actor, or Ray waits forever to place one.

    Args:
        this_machine (bool): A ``ray.num_cpus`` / ``ray.num_gpus`` left null is this
            machine's cores and GPUs; False (planning a run on another machine): only a
            size the config sets is checked.

    Returns:
        list[str]: One ``ray.<resource>: ...`` line per resource the actors need more of.
    """
    problems: list[str] = []
    ray_section = values.get("ray")
    if not isinstance(ray_section, dict) or ray_section.get("address") is not None:
        return problems  # an existing cluster: its size is not known here
    for resource in ("num_cpus", "num_gpus"):
        needed, terms = 0.0, []
        for role in ROLES:
            per_actor = value_at(values, f"{role.name}.{resource}")
            count = value_at(values, f"orchestration.{role.count_key}", (int,))
            if per_actor is None or count is None:
                break
            needed += per_actor * count
            terms.append(f"{count} x {role.name}.{resource} ({per_actor})")
        else:
            if needed == 0:
                continue
            have = value_at(values, f"ray.{resource}")
            if have is None and not this_machine:
                continue  # the other machine's size: the memory plan says what it needs
            if have is None:
                have = (os.cpu_count() or 1) if resource == "num_cpus" else _visible_gpus()
            if needed > have + 1e-9:
                problems.append(
                    f"ray.{resource}: the actors need {needed:g} ({' + '.join(terms)}) but the "
                    f"local Ray cluster has {have:g}; raise ray.{resource} or lower the "
                    "per-actor amounts"
                )
    return problems


def _visible_gpus() -> int:
    import torch  # only when a config leaves ray.num_gpus to this machine

    return torch.cuda.device_count()
