"""The shipped multi-turn example: sums of two two-digit numbers, with a calculator tool.

A tiny model cannot add two-digit numbers itself, but it can call the calculator in the Hermes
format (``<tool_call>{"name": "calculator", ...}</tool_call>``), read the result in the next turn
(``tool: 40``) and write it as its answer. ``data/arithmetic_tools.jsonl`` holds every problem
``a+b=`` with 10 <= a, b <= 39 (written by ``examples/make_task.py``). The start checkpoint is the
arithmetic example's tiny Llama after a short supervised warm-up on a mixture of whole episodes
(call, result, answer) and direct answers, stopped while it still answers directly as often as it
calls the tool, so that RL has a choice to learn: the reward rises as it learns to call the
calculator and copy its result.
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
from shardflow.examples.arithmetic import CALL_LAYOUTS, TOKENIZER_DIR, supervised_warmup
from shardflow.rl.envs.chat import ObservationFormat
from shardflow.rl.envs.tools import load_tools, tool_schema

DATA_DIR = Path(__file__).parent / "data"
TASK_FILE = DATA_DIR / "arithmetic_tools.jsonl"
CONFIG_FILE = Path(__file__).parent / "arithmetic_tools.yaml"
LOW, HIGH = 10, 39
WARMUP_STEPS, WARMUP_BATCH, WARMUP_LR = 300, 64, 3e-3
# Of the warm-up's examples, whole episodes with the calculator (the rest: direct answers): the start then
# calls in about half of its episodes (0.44 of its first tokens; a share of 0.5 gave 0.65).
TOOL_SHARE = 0.45
# A start that writes the call above this many nats (given its first token) is made again from the next
# seed: good starts take about 0.2, failed ones about 9 (``make_start_checkpoint``).
MAX_CALL_NLL, WARMUP_SEEDS, CHECK_EVERY = 2.0, 3, 40


def problems() -> list[dict[str, str]]:
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]


def write_task(data_dir: Path = DATA_DIR) -> None:
    """Write the task file (what ``examples/make_task.py`` runs)."""
    with (data_dir / TASK_FILE.name).open("w") as f:
        for row in problems():
            f.write(json.dumps(row) + "\n")


def tool_call(expression: str) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expression


def episode_examples(tokenizer) -> tuple[list, list]:
    """(episodes, direct answers) for the warm-up: token ids and a 0/1 loss mask each, exactly
    as a run's engine lays them out (the prompt by the chat template, the observation by
    ``ObservationFormat``)."""
    schemas = [tool_schema(fn) for fn in load_tools(["calculator"]).values()]
    prompts = load_prompts(DataConfig(path=str(TASK_FILE)), tokenizer, tools=schemas)
    observations = ObservationFormat(tokenizer, "tool", chat=True)
    eos = tokenizer.eos_token_id
    stop_text = tokenizer.decode([eos])

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    episodes, direct = [], []
    for p in prompts:
        answer = ids(str(p.answer)) + [eos]
        call = ids(tool_call(p.text.split("user: ", 1)[-1].split("=")[0])) + [eos]
        result = observations.ids(str(p.answer), stop_text)
        episodes.append((list(p.ids) + call + result + answer,
                         [0] * len(p.ids) + [1] * len(call) + [0] * len(result) + [1] * len(answer)))
        direct.append((list(p.ids) + answer, [0] * len(p.ids) + [1] * len(answer)))
    return episodes, direct


def make_start_checkpoint(path: str | Path, *, steps: int = WARMUP_STEPS, seed: int = 0) -> Path:
    """A random tiny Llama after ``steps`` supervised steps on the warm-up mixture, written to
    ``path`` with the tokenizer. Made once: an existing checkpoint is kept.

    The warm-up at a constant rate is chaotic: a seed that gives a start writing the calculator
    call at about 0.2 nats under one machine's numerics gave one at 9 nats (no call the environment
    can parse, nothing for RL to learn) under another's. A start is therefore checked (``call_nll``)
    and the warm-up run again from the next seed, up to ``WARMUP_SEEDS`` seeds, while it fails."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    episodes, direct = episode_examples(tokenizer)

    def draw(gen: torch.Generator) -> list[tuple[list[int], list[int]]]:
        picked = torch.randint(len(episodes), (WARMUP_BATCH,), generator=gen).tolist()
        tool = (torch.rand(WARMUP_BATCH, generator=gen) < TOOL_SHARE).tolist()
        return [episodes[i] if t else direct[i] for i, t in zip(picked, tool)]

    tried = []
    for s in range(seed, seed + WARMUP_SEEDS):
        trial = path.with_name(f"{path.name}.seed{s}")
        shutil.rmtree(trial, ignore_errors=True)
        supervised_warmup(trial, tokenizer, draw, steps=steps, lr=WARMUP_LR, seed=s)
        nll = call_nll(trial, episodes[::CHECK_EVERY]) if steps else 0.0
        if nll <= MAX_CALL_NLL:
            trial.rename(path)
            return path
        shutil.rmtree(trial)
        tried.append(f"seed {s}: {nll:.2f}")
    raise RuntimeError(f"the tool example's warm-up gave no start that writes the calculator call within "
                       f"{MAX_CALL_NLL} nats ({', '.join(tried)})")


def call_nll(path: Path, episodes: list[tuple[list[int], list[int]]]) -> float:
    """Mean negative log-likelihood (nats) of the calculator call in ``episodes`` under the model at
    ``path``, given the call's first token (the choice to call, which the warm-up leaves at about
    even odds): how surely the start writes a call once it begins one."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    total = 0.0
    with torch.no_grad():
        for ids, mask in episodes:
            begin = mask.index(1)
            end = begin + mask[begin:].index(0)  # the call and its end-of-turn token
            logprobs = torch.log_softmax(model(torch.tensor([ids[:end]])).logits[0, begin:end - 1], -1)
            total -= logprobs.gather(-1, torch.tensor(ids[begin + 1:end])[:, None]).sum().item()
    return total / len(episodes)


def example_config(out_dir: str | Path, algorithm: str = "grpo") -> dict[str, Any]:
    """The multi-turn example's config mapping, its start checkpoint made under ``out_dir``."""
    raw = yaml.safe_load(CONFIG_FILE.read_text())
    out_dir = Path(out_dir)
    start = make_start_checkpoint(out_dir / "start")
    raw["algorithm"]["name"] = algorithm
    raw["data"]["path"] = str(TASK_FILE)
    raw["models"] = {role: {**spec, "path": str(start)} for role, spec in raw["models"].items()}
    plan = out_dir / "plan-tools.yaml"
    out_dir.mkdir(parents=True, exist_ok=True)
    plan.write_text(yaml.safe_dump({"calls": {c: CALL_LAYOUTS[c] for c in ("actor_gen", "ref_inf", "actor_train")}}))
    raw["plan"] = str(plan)
    return raw
