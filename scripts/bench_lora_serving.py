"""Generation with a LoRA policy on the demo's collector engine: served as a vLLM LoRA adapter or
merged into the base weights (``training.lora.serve``), beside full weights.

Each way runs in a subprocess of its own, round-robin: a vLLM engine built as the collector
builds it for ``--config``, then ``--batches`` generation batches of ``inference.batch_size x
group_size`` responses (random prompts of 15 tokens), each after a new policy version (a
random adapter with B != 0) is loaded as the collector loads it, on one thread as the
collector actor has. Prints per way the median seconds per batch and per update, and the tokens
sampled.

    python scripts/bench_lora_serving.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

WAYS = ("full", "adapter", "merged")


def random_adapter(model_dir: str, lora, seed: int) -> dict:
    """PEFT-named adapter tensors of every target of every layer, B != 0."""
    import torch

    from grpo.models import build_model, load_hf_config
    from grpo.models.lora import adapter_state_dict, apply_lora, peft_adapter_state_dict

    model = build_model(model_dir)
    torch.manual_seed(seed)
    apply_lora(model, lora)
    state = adapter_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in state.items():
        if name.endswith("lora_b.weight"):
            tensor.copy_(0.01 * torch.randn(tensor.shape, generator=generator))
    return peft_adapter_state_dict(state, load_hf_config(model_dir))


def one_way(way: str, config_name: str, batches: int) -> dict:
    """Time ``batches`` updates and generation batches served ``way``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from grpo.config import load_config
    from grpo.models import load_hf_state_dict
    from grpo.models.lora import merge_peft_adapter
    from grpo.weights.adapter import MergedAdapters, engine_adapters
    from grpo.weights.checksum import state_dict_checksum
    from grpo.weights.engine import WeightUpdate
    from grpo.workers.vllm_engine import build_engine

    cfg = load_config(config_name)
    inference, lora = cfg.inference, cfg.training.lora
    model_dir = str(cfg.base_model_path)
    rank = lora.rank if way == "adapter" else None
    llm = build_engine(model_dir, inference, cfg.seed, inference.max_generated_tokens, rank).llm
    adapters = engine_adapters(llm, lora, model_dir, None, 0) if way == "adapter" else None
    merged = MergedAdapters(model_dir, lora) if way == "merged" else None
    peft = random_adapter(model_dir, lora, seed=1)
    # Full fine-tuning's update: the same policy as full weights.
    full = merge_peft_adapter(load_hf_state_dict(model_dir), peft, lora.alpha / lora.rank)
    rng = random.Random(0)
    count = inference.batch_size * inference.group_size
    prompts = []
    for _ in range(inference.batch_size):
        prompt = TokensPrompt(prompt_token_ids=[rng.randrange(10, 500) for _ in range(15)])
        prompts += [prompt] * inference.group_size
    update_s, generate_s, tokens = [], [], []
    for version in range(1, batches + 2):
        start, request = time.perf_counter(), None
        checksum = state_dict_checksum(peft)
        if adapters is not None:
            adapters.load(peft, version, checksum)
            adapters.activate(version)
            request = adapters._requests[version]
        else:
            if merged is not None:
                update = merged.merged_update(WeightUpdate(version, peft, checksum))
                weights, checksum = update.weights, update.checksum
            else:
                weights, checksum = full, state_dict_checksum(full)
            llm.collective_rpc("grpo_update_weights", args=(weights, True))
            llm.reset_prefix_cache()
        loaded = time.perf_counter()
        params = [
            SamplingParams(
                max_tokens=inference.max_generated_tokens,
                temperature=inference.temperature,
                logprobs=0,
                seed=1000 * version + k,
            )
            for k in range(count)
        ]
        outputs = llm.generate(prompts, params, lora_request=request, use_tqdm=False)
        if version > 1:  # the first batch warms up
            update_s.append(loaded - start)
            generate_s.append(time.perf_counter() - loaded)
            tokens.append(sum(len(o.outputs[0].token_ids) for o in outputs))
    return {
        "way": way,
        "update_s": statistics.median(update_s),
        "generate_s": statistics.median(generate_s),
        "tokens": statistics.mean(tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny_arithmetic_lora_cpu")
    parser.add_argument("--batches", type=int, default=8, help="timed batches per run")
    parser.add_argument("--repeats", type=int, default=3, help="round-robin runs of each way")
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # a subprocess's
    args = parser.parse_args()
    if args.way:
        print("RESULT " + json.dumps(one_way(args.way, args.config, args.batches)))
        return
    results: dict[str, list[dict]] = {way: [] for way in WAYS}
    for _ in range(args.repeats):
        for way in WAYS:
            command = [sys.executable, __file__, "--way", way, "--config", args.config]
            command += ["--batches", str(args.batches)]
            # One thread, as a collector actor with num_cpus 1 has (Ray sets OMP_NUM_THREADS).
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            run = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
            output = run.stdout
            line = next(line for line in output.splitlines() if line.startswith("RESULT "))
            results[way].append(json.loads(line.removeprefix("RESULT ")))
    with open("/proc/loadavg") as load:
        print(f"load average at the end: {load.read().split()[0]}")
    print(f"{'served as':<10} {'generate s/batch':>17} {'update ms':>10} {'tokens/batch':>13}")
    for way, runs in results.items():
        generate = statistics.median(r["generate_s"] for r in runs)
        update = statistics.median(r["update_s"] for r in runs)
        tokens = statistics.mean(r["tokens"] for r in runs)
        print(f"{way:<10} {generate:>17.3f} {1e3 * update:>10.1f} {tokens:>13.0f}")


if __name__ == "__main__":
    main()
