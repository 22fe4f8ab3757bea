"""Build the tiny demo model: a small Qwen2 that is partly competent at arithmetic.

The CPU demo (``configs/tiny_arithmetic_cpu.yaml``) needs a starting policy that already
writes ``<answer>85</answer>`` and stops, but gets only some of the answers right, so that GRPO
has visible headroom. This script makes one, reproducibly:

1. `grpo.testing.build_tiny_qwen2` writes a random Qwen2 folder with the byte-level BPE
   tokenizer (digits are single tokens).
2. Supervised training on the seeded arithmetic TRAIN split: cross-entropy on the response
   tokens only (``<answer>85</answer><|im_end|>``), prompts ``"What is 37 + 48?\\n"``.
3. Every ``--eval-every`` steps, greedy accuracy on held-out TEST-split questions (a batched
   greedy loop on the torchtune model). Training stops after ``--max-steps`` (700 for the
   shipped model: the format is learned, ~17% of the answers are right), or as soon as it
   reaches ``--target-accuracy`` when one is given. A fixed step count reproduces the same
   weights wherever the accuracy lands; stopping at an accuracy is for trying other points.
4. The weights are saved with `grpo.models.save_hf_checkpoint` (HF layout: vLLM, torchtune).

Why 700 steps: the model then writes the format always and gets a sixth of the answers right,
and two in five groups of 8 samples hold both right and wrong answers. The next 50 supervised
steps would take it to ~31% (the earlier demo model): headroom that GRPO reaches in minutes. From
700 steps the demo gains 21-27 points in 1000 GRPO steps; from 750 it gained 14-17 in 800.

With ``--tool-fraction F`` a share F of the training examples answers through the calculator
in the turns of a tool episode (``<calculator>37 * 48</calculator>``, then the environment's
``<result>1776</result>``, not trained, then ``<answer>1776</answer>``): the tool demo's model
(``configs/tiny_calculator_cpu.yaml``), which answers directly when greedy but sometimes calls
the tool when sampling, and copies a tool's result into its answer.

With ``--chat-tools`` as well, the examples are chat conversations as an agent program holds
them (the agent demo's model, ``configs/tiny_agent_cpu.yaml``, with
``grpo/examples/calculator_agent.py``): the model's chat template (`AGENT_CHAT_TEMPLATE`) is
written into the tokenizer, each prompt is the user's question rendered with the calculator
tool, a tool call is ``<tool_call>{"name": "calculator", "arguments": {...}}</tool_call>``
(the ``json`` call format), and the tool's result comes back as a ``tool`` turn, bridged as
`grpo.envs.AgentEnv` bridges it: the tokens match an agent episode's token for token.

Usage::

    python scripts/build_tiny_arithmetic_model.py --out assets/tiny_arithmetic_qwen2
    python scripts/build_tiny_arithmetic_model.py --out assets/tiny_calculator_qwen2 --tool-fraction 0.15 --num-threads 2
    python scripts/build_tiny_arithmetic_model.py --out assets/tiny_agent_qwen2 --tool-fraction 0.15 --chat-tools --num-threads 2

The held-out questions used for stopping (``--eval-seed``) differ from the demo config's
``eval_dataset`` (seed 1), so the demo's start accuracy is not selected on its own eval set.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from grpo.data import AnswerOnlyTemplate, PromptDataset, arithmetic_dataset
from grpo.models import build_model, load_tokenizer, save_hf_checkpoint
from grpo.testing import build_tiny_qwen2

# Loss positions that are not response tokens.
IGNORE_INDEX = -100
# "<answer>" + "-" + up to 4 digits + "</answer>" is 9 tokens; the EOS makes 10.
MAX_NEW_TOKENS = 12
_ANSWER_ONLY_RE = re.compile(r"<answer>(?P<answer>[^<]*)</answer>")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("assets/tiny_arithmetic_qwen2"))
    parser.add_argument("--seed", type=int, default=0, help="weights, data order, init")
    # Architecture. Head dim = embed_dim // num_heads must be 64 for vLLM's CPU attention.
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--embed-dim", type=int, default=128)
    parser.add_argument("--num-heads", type=int, default=2)
    parser.add_argument("--num-kv-heads", type=int, default=1)
    parser.add_argument("--intermediate-dim", type=int, default=512)
    # Data: the same generator and options as the demo config's `dataset`.
    parser.add_argument("--num-train-examples", type=int, default=200_000)
    parser.add_argument("--max-value", type=int, default=99)
    parser.add_argument("--num-eval-examples", type=int, default=512)
    parser.add_argument("--eval-seed", type=int, default=2)
    # Optimisation.
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--max-steps", type=int, default=700, help="supervised steps")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument(
        "--target-accuracy",
        type=float,
        default=None,
        help="stop as soon as held-out greedy accuracy reaches this (default: run --max-steps)",
    )
    # One thread: the result does not depend on the machine's core count (float reductions
    # split across threads round differently), and this model is too small to gain from more.
    parser.add_argument(
        "--tool-fraction",
        type=float,
        default=0.0,
        help="share of the training examples answered through the calculator tool (the "
        "tool demo's model: configs/tiny_calculator_cpu.yaml)",
    )
    parser.add_argument(
        "--chat-tools",
        action="store_true",
        help="chat conversations with a calculator tool, as an agent program holds them (the "
        "agent demo's model: configs/tiny_agent_cpu.yaml)",
    )
    parser.add_argument("--num-threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--snapshot-dir",
        type=Path,
        default=None,
        help="also save a checkpoint at every evaluation, as SNAPSHOT_DIR/step_N (to try "
        "other starting points)",
    )
    return parser.parse_args()


# The agent demo model's chat template: ChatML turns, a system line naming the tools, tool
# calls as <tool_call>{json}</tool_call>. A family's published tool preamble (Qwen2.5's is ~600
# tokens with this 509-token vocabulary) would make every prompt five times longer than the
# episode; `tests/unit/test_agent_env.py` runs the published Qwen3 and Llama 3.1 templates.
AGENT_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for tool in tools %} "
    "{{ (tool.function or tool).name }}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{%- for call in message.tool_calls or [] %}"
    '<tool_call>{"name": "{{ call.function.name }}", "arguments": '
    "{% if call.function.arguments is string %}{{ call.function.arguments }}"
    "{% else %}{{ call.function.arguments | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# One training example: prompt ids, response ids, and per response token whether it is trained
# (False on a tool result: the environment writes it, the policy only reads it).
Example = tuple[list[int], list[int], list[bool]]


def calculator_expression(question: str) -> str:
    """The expression of ``"What is 37 * 48?"``: ``"37 * 48"`` (what the tool call copies)."""
    return question.removeprefix("What is ").removesuffix("?")


def encode_examples(
    dataset: PromptDataset,
    tokenizer,
    template: AnswerOnlyTemplate,
    tool_fraction: float = 0.0,
    rng: random.Random | None = None,
) -> list[Example]:
    """Token ids of every example: ``(prompt_ids, response_ids, trained)``, ending in EOS.

    The prompt is encoded on its own, exactly as the collector encodes it, and the response
    separately: the policy sees the same prompt tokens at training and at generation time.

    With ``tool_fraction``, that share of the examples (drawn with ``rng``) answers through the
    calculator, in the turns a tool episode has (`grpo.envs.ToolEnv`, tag format, plain turns):
    ``<calculator>37 * 48</calculator>`` (trained), ``<result>1776</result>`` (the
    environment's turn: in the sequence, not trained), ``<answer>1776</answer>`` and EOS
    (trained). Each turn is encoded on its own, as the rollout samples and renders it.
    """
    from grpo.envs.builtin_tools import calculator

    encoded = []
    for index in range(len(dataset)):
        example = dataset[index]
        prompt_ids = tokenizer.encode(example["prompt"], add_bos=True, add_eos=False)
        answer_ids = tokenizer.encode(template.target(example["answer"]), add_bos=False)
        if answer_ids[-1] != tokenizer.eos_id:  # encode appends EOS by default
            answer_ids.append(tokenizer.eos_id)
        if tool_fraction and rng is not None and rng.random() < tool_fraction:
            expression = calculator_expression(example["question"])
            call_ids = tokenizer.encode(
                f"<calculator>{expression}</calculator>", add_bos=False, add_eos=False
            )
            result_ids = tokenizer.encode(
                f"<result>{calculator(expression)}</result>", add_bos=False, add_eos=False
            )
            response = call_ids + result_ids + answer_ids
            trained = [True] * len(call_ids) + [False] * len(result_ids) + [True] * len(answer_ids)
            encoded.append((prompt_ids, response, trained))
        else:
            encoded.append((prompt_ids, answer_ids, [True] * len(answer_ids)))
    return encoded


def encode_chat_examples(
    dataset: PromptDataset,
    tokenizer,
    template: AnswerOnlyTemplate,
    tool_fraction: float = 0.0,
    rng: random.Random | None = None,
) -> list[Example]:
    """`encode_examples` as chat conversations with the calculator tool (``--chat-tools``).

    The prompt is the question rendered by the chat template with the agent's tool, as the
    endpoint renders an agent's first call; a tool answer is the call and a stop token
    (trained), the ``tool`` turn as `grpo.envs.ChatTurnRenderer` bridges it (not trained),
    then ``<answer>1776</answer>`` and a stop token (trained).
    """
    from grpo.envs.builtin_tools import calculator
    from grpo.envs.render import ChatTurnRenderer
    from grpo.examples.calculator_agent import CALCULATOR_TOOL

    renderer = ChatTurnRenderer(tokenizer)
    encoded = []
    for index in range(len(dataset)):
        example = dataset[index]
        messages = [{"role": "user", "content": example["question"]}]
        text = tokenizer.apply_chat_template(
            messages, tools=[CALCULATOR_TOOL], add_generation_prompt=True
        )
        prompt_ids = tokenizer.encode(text, add_bos=True, add_eos=False)
        answer_ids = tokenizer.encode(template.target(example["answer"]), add_bos=False)
        if answer_ids[-1] != tokenizer.eos_id:
            answer_ids.append(tokenizer.eos_id)
        if tool_fraction and rng is not None and rng.random() < tool_fraction:
            expression = calculator_expression(example["question"])
            arguments = json.dumps({"expression": expression})
            call = f'<tool_call>{{"name": "calculator", "arguments": {arguments}}}</tool_call>'
            call_ids = tokenizer.encode(call, add_bos=False, add_eos=False) + [tokenizer.eos_id]
            result_ids = renderer.env_tokens(
                [{"role": "tool", "content": calculator(expression)}], closed=True, history=messages
            )
            response = call_ids + result_ids + answer_ids
            trained = [True] * len(call_ids) + [False] * len(result_ids) + [True] * len(answer_ids)
            encoded.append((prompt_ids, response, trained))
        else:
            encoded.append((prompt_ids, answer_ids, [True] * len(answer_ids)))
    return encoded


def write_chat_template(model_dir: Path, chat_template: str) -> None:
    """Set ``chat_template`` in the folder's ``tokenizer_config.json``."""
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = chat_template
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def collate(batch: list[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``tokens`` and ``labels`` (``IGNORE_INDEX`` where nothing is trained).

    ``labels[i, t]`` is the token the model must predict at position ``t`` (the next token), so
    the loss is a plain cross-entropy of ``logits[:, t]`` against ``labels[:, t]``.
    """
    length = max(len(prompt) + len(response) for prompt, response, _ in batch)
    tokens = torch.full((len(batch), length), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), length), IGNORE_INDEX, dtype=torch.long)
    for row, (prompt, response, trained) in enumerate(batch):
        sequence = prompt + response
        tokens[row, : len(sequence)] = torch.tensor(sequence)
        # Position t predicts token t + 1: the last prompt position predicts the first
        # response token, the last response token (EOS) is only a target.
        targets = torch.tensor(response)
        targets[~torch.tensor(trained)] = IGNORE_INDEX
        labels[row, len(prompt) - 1 : len(sequence) - 1] = targets
    return tokens, labels


@torch.no_grad()
def greedy_completions(
    model, prompts: list[list[int]], tokenizer, max_new_tokens: int = MAX_NEW_TOKENS
) -> list[str]:
    """Greedy completions of token-id prompts, decoded without special tokens.

    Prompts are grouped by length, so every row of a batch sits at the same position and no
    padding or attention mask is needed; each step re-runs the whole sequence (no KV cache:
    the sequences are ~20 tokens long). A row stops at the first stop token.
    """
    was_training = model.training
    model.eval()
    by_length: dict[int, list[int]] = {}
    for index, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(index)
    stop_ids = torch.tensor(sorted(tokenizer.stop_tokens))
    completions = [""] * len(prompts)
    for indices in by_length.values():
        tokens = torch.tensor([prompts[i] for i in indices])
        prompt_length = tokens.shape[1]
        finished = torch.zeros(len(indices), dtype=torch.bool)
        for _ in range(max_new_tokens):
            next_ids = model(tokens)[:, -1].argmax(dim=-1)
            # Finished rows keep emitting a stop token, which decoding drops.
            next_ids = torch.where(finished, stop_ids[0], next_ids)
            tokens = torch.cat([tokens, next_ids[:, None]], dim=1)
            finished |= torch.isin(next_ids, stop_ids)
            if finished.all():
                break
        for row, index in enumerate(indices):
            response = tokens[row, prompt_length:].tolist()
            stop_at = [t for t, token in enumerate(response) if token in tokenizer.stop_tokens]
            # Keep the first stop token so that `format_ok` can see the response ended.
            response = response[: stop_at[0] + 1] if stop_at else response
            completions[index] = tokenizer.decode(response, skip_special_tokens=False)
    model.train(was_training)
    return completions


def score(completions: list[str], answers: list[str], eos_token: str) -> tuple[float, float]:
    """Held-out accuracy and format rate of greedy completions.

    A completion is well formed when it is exactly ``<answer>...</answer>`` followed by the
    EOS token; it is correct when the answer inside the tags equals the gold answer (integers,
    so string equality is what math-verify decides too).
    """
    correct = formatted = 0
    for completion, answer in zip(completions, answers):
        body = completion.removesuffix(eos_token)
        match = _ANSWER_ONLY_RE.fullmatch(body)
        formatted += match is not None and completion.endswith(eos_token)
        found = _ANSWER_ONLY_RE.search(body)
        correct += found is not None and found.group("answer").strip() == answer
    return correct / len(answers), formatted / len(answers)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    work_dir = Path(tempfile.mkdtemp(prefix="tiny_arithmetic_"))
    try:
        base_dir = build_tiny_qwen2(
            work_dir / "init",
            num_layers=args.num_layers,
            embed_dim=args.embed_dim,
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            intermediate_dim=args.intermediate_dim,
            seed=args.seed,
        )
        if args.chat_tools:
            write_chat_template(base_dir, AGENT_CHAT_TEMPLATE)
        tokenizer = load_tokenizer(base_dir)
        model = build_model(base_dir)
        num_params = sum(p.numel() for p in model.parameters())
        print(f"model: {num_params / 1e6:.2f}M parameters")

        template = AnswerOnlyTemplate()
        train_set = arithmetic_dataset(
            num_examples=args.num_train_examples,
            seed=args.seed,
            max_value=args.max_value,
            split="train",
            template=template,
        )
        eval_set = arithmetic_dataset(
            num_examples=args.num_eval_examples,
            seed=args.eval_seed,
            max_value=args.max_value,
            split="test",
            template=template,
        )
        encode = encode_chat_examples if args.chat_tools else encode_examples
        train_examples = encode(
            train_set, tokenizer, template, args.tool_fraction, random.Random(args.seed + 1)
        )
        eval_prompts = [prompt for prompt, _, _ in encode(eval_set, tokenizer, template)]
        eval_answers = [eval_set[i]["answer"] for i in range(len(eval_set))]

        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        # Linear warm-up, then constant: training stops early, long before it converges.
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / args.warmup_steps)
        )
        order: list[int] = []
        accuracy = format_rate = 0.0
        started = time.perf_counter()
        step = 0
        for step in range(1, args.max_steps + 1):
            if len(order) < args.batch_size:
                order = list(range(len(train_examples)))
                rng.shuffle(order)
            batch = [train_examples[order.pop()] for _ in range(args.batch_size)]
            tokens, labels = collate(batch, tokenizer.pad_id)
            logits = model(tokens)
            loss = F.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()

            if step % args.eval_every == 0 or step == args.max_steps:
                completions = greedy_completions(model, eval_prompts, tokenizer)
                accuracy, format_rate = score(completions, eval_answers, "<|im_end|>")
                tool_calls = sum(c.startswith(("<calculator>", "<tool_call>")) for c in completions)
                elapsed = time.perf_counter() - started
                print(
                    f"step {step:5d}  loss {loss.item():.4f}  held-out accuracy {accuracy:.3f}  "
                    f"format {format_rate:.3f}  greedy tool calls {tool_calls / len(completions):.3f}"
                    f"  ({elapsed:.0f} s)",
                    flush=True,
                )
                if args.snapshot_dir is not None:
                    save_hf_checkpoint(
                        model.state_dict(), base_dir, args.snapshot_dir / f"step_{step}"
                    )
                if args.target_accuracy is not None and accuracy >= args.target_accuracy:
                    break
        sft_seconds = time.perf_counter() - started
        if args.target_accuracy is not None and accuracy < args.target_accuracy:
            raise SystemExit(
                f"held-out accuracy {accuracy:.3f} is below --target-accuracy "
                f"{args.target_accuracy} after {step} steps; raise --max-steps or --lr"
            )

        out_dir = save_hf_checkpoint(model.state_dict(), base_dir, args.out)
        # safetensors writes its files owner-only (0600); the shipped folder is for everyone.
        for path in out_dir.iterdir():
            path.chmod(0o644)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)

    folder_bytes = sum(path.stat().st_size for path in out_dir.iterdir() if path.is_file())
    print(f"SFT: {step} steps in {sft_seconds:.0f} s")
    print(f"held-out greedy accuracy (torchtune): {accuracy:.3f}, format: {format_rate:.3f}")
    print(f"wrote {out_dir} ({folder_bytes / 2**20:.2f} MiB, {num_params / 1e6:.2f}M params)")


if __name__ == "__main__":
    main()
