"""The shipped example task: sums of two small numbers, answered with one number.

``data/arithmetic.jsonl`` holds every problem ``a+b=`` with 0 <= a, b <= 5, its answer and a wrong
one (``rejected``, for preference algorithms);
``data/char_tokenizer/`` the character tokenizer of ``shardflow.models.tiny`` (both written by
``examples/make_task.py``). A randomly initialised tiny model almost never writes a number followed
by the end-of-sequence token, so the run starts from a checkpoint made once by
``make_start_checkpoint``: a random tiny Llama given a short supervised warm-up on the task's
format (a few seconds on a CPU), stopped early, when about a third of its answers are right, so
that GRPO has the rest to learn.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from shardflow.config.experiment import DataConfig
from shardflow.config.load import load_config
from shardflow.data.prompts import load_prompts
from shardflow.models.tiny import char_tokenizer, make_tiny_checkpoint
from shardflow.rl.algorithms import algorithm_named

DATA_DIR = Path(__file__).parent / "data"
TASK_FILE = DATA_DIR / "arithmetic.jsonl"
TOKENIZER_DIR = DATA_DIR / "char_tokenizer"
CONFIG_FILE = Path(__file__).parent / "arithmetic_grpo.yaml"
MAX_OPERAND = 5

# the starting model: ~165K parameters
MODEL_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2)
WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR = 35, 64, 3e-3


def problems(max_operand: int = MAX_OPERAND) -> list[dict[str, str]]:
    """Every ``a+b=`` with 0 <= a, b <= max_operand, as dataset rows: the answer, and a wrong one."""
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b), "rejected": str(a + b + 1 + (a * b) % 3)}
            for a in range(max_operand + 1) for b in range(max_operand + 1)]


def write_task(data_dir: Path = DATA_DIR) -> None:
    """Write the task file and the tokenizer files (what ``examples/make_task.py`` runs)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with (data_dir / TASK_FILE.name).open("w") as f:
        for row in problems():
            f.write(json.dumps(row) + "\n")
    char_tokenizer().save_pretrained(data_dir / TOKENIZER_DIR.name)


def make_start_checkpoint(path: str | Path, *, steps: int = WARMUP_STEPS, seed: int = 0) -> Path:
    """A random tiny Llama after ``steps`` supervised steps on the task, written to ``path`` as a
    Hugging Face checkpoint with the tokenizer. Made once: an existing checkpoint is kept."""
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    prompts = load_prompts(DataConfig(path=str(TASK_FILE)), tokenizer)
    # prompt + answer + EOS, the loss on the answer and EOS only
    examples = []
    for p in prompts:
        answer = tokenizer(str(p.answer), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        examples.append((list(p.ids) + answer, [0] * len(p.ids) + [1] * len(answer)))

    def draw(gen: torch.Generator) -> list[tuple[list[int], list[int]]]:
        return [examples[i] for i in torch.randint(len(examples), (WARMUP_BATCH,), generator=gen).tolist()]

    return supervised_warmup(path, tokenizer, draw, steps=steps, lr=WARMUP_LR, seed=seed)


def supervised_warmup(path: str | Path, tokenizer, draw: Callable[[torch.Generator], list[tuple[list[int], list[int]]]],
                      *, steps: int, lr: float, seed: int = 0) -> Path:
    """A random tiny Llama of ``MODEL_SHAPE`` trained for ``steps`` steps on batches ``draw(gen)``
    of (token ids, 0/1 loss mask), saved to ``path`` with ``tokenizer`` (through a temporary
    directory, so that a half-made checkpoint is never taken for a made one). An existing
    checkpoint is kept."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    make_tiny_checkpoint(tmp, "llama", seed=seed, with_tokenizer=False, **MODEL_SHAPE)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        batch = draw(gen)
        targets_in_batch = sum(sum(mask[1:]) for _, mask in batch)
        # the batch's mean loss over its target tokens, in one forward per length (no padding:
        # the tool example mixes 130-token episodes with 30-token direct answers)
        for group in by_length(batch):
            ids, targets = padded(group, tokenizer.pad_token_id)  # [B, T] each
            logits = model(ids).logits[:, :-1]  # [B, T-1, vocab]
            loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets[:, 1:], ignore_index=-100,
                                                     reduction="sum")
            (loss / targets_in_batch).backward()
        optimizer.step()
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(path)
    return path


def by_length(examples: list[tuple[list[int], list[int]]]) -> list[list[tuple[list[int], list[int]]]]:
    """The examples grouped by their length, in order of first appearance."""
    groups: dict[int, list] = {}
    for example in examples:
        groups.setdefault(len(example[0]), []).append(example)
    return list(groups.values())


def padded(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and targets [B, T] (-100 except where the mask is 1)."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id)
    targets = torch.full((len(examples), width), -100)
    for row, (seq, mask) in enumerate(examples):
        ids[row, :len(seq)] = torch.tensor(seq)
        keep = torch.tensor(mask, dtype=torch.bool)
        targets[row, :len(seq)] = torch.where(keep, torch.tensor(seq), -100)
    return ids, targets


# The example's calls, each in its own layout over 4 ranks: generation throughput-oriented (four
# replicas), the reference and the critic on two ranks each, training with 2 pipeline stages x tp 2.
CALL_LAYOUTS = {
    "actor_gen": "d4p1t1@0-3",
    "actor_gen_greedy": "d2p1t1@0-1",
    "reward_inf": "d2p1t1@2-3",
    "baseline_reward_inf": "d2p1t1@2-3",
    "ref_inf": "d2p1t1@2-3",
    "critic_inf": "d2p1t1@0-1",
    "actor_inf": "d2p1t2@0-3",
    "actor_train": "d1p2t2@0-3",
    "critic_train": "d2p1t2@0-3",
}
# What each offline algorithm reads of the task's rows
OFFLINE_DATA = {"sft": {"response_key": "answer"}, "dpo": {"chosen_key": "answer", "rejected_key": "rejected"}}


def make_start_critic(start: Path, path: Path) -> Path:
    """A value model for the example's PPO: the starting checkpoint's body with a new value head."""
    if (path / "config.json").is_file():
        return path
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    critic = AutoModelForSequenceClassification.from_pretrained(start, num_labels=1, dtype=torch.float32)
    critic.config.pad_token_id = critic.config.pad_token_id or 0
    critic.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(start).save_pretrained(tmp)
    tmp.rename(path)
    return path


def example_config(out_dir: str | Path, algorithm: str = "grpo") -> dict[str, Any]:
    """The example run's config mapping (for ``load_config(None, overrides, base=...)``) for
    ``algorithm``, with its starting checkpoints made under ``out_dir`` if they are not there yet
    and a plan of the algorithm's calls written there."""
    raw = yaml.safe_load(CONFIG_FILE.read_text())
    out_dir = Path(out_dir)
    start = make_start_checkpoint(out_dir / "start")
    raw["algorithm"]["name"] = algorithm
    raw["data"]["path"] = str(TASK_FILE)
    raw["data"].update(OFFLINE_DATA.get(algorithm, {}))
    if algorithm in OFFLINE_DATA:
        del raw["algorithm"]["kl"]  # DPO's reference is no KL term; SFT has none
    graph = algorithm_named(algorithm).graph(load_config(None, base=raw))
    paths = {"actor": start, "ref": start, "reward": None, "critic": None}
    if "critic" in graph.models():
        paths["critic"] = make_start_critic(start, out_dir / "start-critic")
    raw["models"] = {role: {**raw["models"].get(role, {}), "path": str(paths[role])} for role in graph.models()}
    plan = out_dir / f"plan-{algorithm}.yaml"
    out_dir.mkdir(parents=True, exist_ok=True)
    plan.write_text(yaml.safe_dump({"calls": {c.name: CALL_LAYOUTS[c.name] for c in graph.model_calls()}}))
    raw["plan"] = str(plan)
    return raw
