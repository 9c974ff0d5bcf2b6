"""The shipped example task: sums of two small numbers, answered with one number.

``data/arithmetic.jsonl`` holds every problem ``a+b=`` with 0 <= a, b <= 5 and its answer;
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
from typing import Any

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardflow.config.experiment import DataConfig
from shardflow.data.prompts import load_prompts
from shardflow.models.tiny import char_tokenizer, make_tiny_checkpoint

DATA_DIR = Path(__file__).parent / "data"
TASK_FILE = DATA_DIR / "arithmetic.jsonl"
TOKENIZER_DIR = DATA_DIR / "char_tokenizer"
CONFIG_FILE = Path(__file__).parent / "arithmetic_grpo.yaml"
PLAN_FILE = Path(__file__).parent / "arithmetic_plan.yaml"
MAX_OPERAND = 5

# the starting model: ~165K parameters
MODEL_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2)
WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR = 35, 64, 3e-3


def problems(max_operand: int = MAX_OPERAND) -> list[dict[str, str]]:
    """Every ``a+b=`` with 0 <= a, b <= max_operand, as dataset rows."""
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)}
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
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    make_tiny_checkpoint(tmp, "llama", seed=seed, with_tokenizer=False, **MODEL_SHAPE)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    prompts = load_prompts(DataConfig(path=str(TASK_FILE)), tokenizer)
    # [len(prompts)] examples: prompt + answer + EOS, the loss on the answer and EOS only
    examples = [(list(p.ids), tokenizer(str(p.answer), add_special_tokens=False)["input_ids"]
                 + [tokenizer.eos_token_id]) for p in prompts]

    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARMUP_LR)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        picked = torch.randint(len(examples), (WARMUP_BATCH,), generator=gen).tolist()
        ids, targets = _padded([examples[i] for i in picked], tokenizer.pad_token_id)  # [B, T] each
        logits = model(ids).logits[:, :-1]  # [B, T-1, vocab]
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets[:, 1:], ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(path)
    return path


def _padded(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and targets [B, T] (-100 except on the answer tokens)."""
    width = max(len(p) + len(a) for p, a in examples)
    ids = torch.full((len(examples), width), pad_id)
    targets = torch.full((len(examples), width), -100)
    for row, (prompt, answer) in enumerate(examples):
        seq = prompt + answer
        ids[row, :len(seq)] = torch.tensor(seq)
        targets[row, len(prompt):len(seq)] = torch.tensor(answer)
    return ids, targets


def example_config(out_dir: str | Path) -> dict[str, Any]:
    """The example run's config mapping (for ``load_config(None, overrides, base=...)``), with its
    starting checkpoint made under ``out_dir`` if it is not there yet."""
    raw = yaml.safe_load(CONFIG_FILE.read_text())
    start = make_start_checkpoint(Path(out_dir) / "start")
    raw["models"]["actor"]["path"] = raw["models"]["ref"]["path"] = str(start)
    raw["data"]["path"] = str(TASK_FILE)
    raw["plan"] = str(PLAN_FILE)
    return raw
