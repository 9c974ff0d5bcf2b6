"""``shardflow generate``: complete the prompts of a JSONL file with a model, under any (dp, tp).

Input lines hold ``{"prompt": "..."}`` or ``{"messages": [...]}`` (the chat template is applied).
Every line is read, tokenized and checked before any rank starts, so bad input fails at once with
its line number and nothing is written. Output lines, in input order (the samples of a prompt
consecutive), hold the input's fields plus ``prompt``, ``sample``, ``completion``,
``completion_ids``, ``logprobs`` and ``finish_reason``. Prompts go through the engine in chunks,
and each chunk's lines are written and flushed as soon as it completes, so an error later in a
run keeps what was written before it.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

from shardflow.config.experiment import BLAS_LIBRARIES, COMPILE_MODES
from shardflow.config.model import ModelConfig
from shardflow.engine.generate.engine import EngineConfig, GenerationEngine
from shardflow.engine.generate.replicas import generate_replicated
from shardflow.engine.generate.requests import Request, SamplingParams, make_requests
from shardflow.models.checkpoint import load_model
from shardflow.parallel.launch import launch
from shardflow.parallel.layout import Layout
from shardflow.parallel.sharding import check_layout

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Job:
    """Everything a rank needs, read and checked before any rank starts."""

    model: str
    layout: str
    output: str
    dtype: str  # "auto" (bfloat16 on GPU, float32 on CPU), "float32" or "bfloat16"
    engine: EngineConfig
    records: list[dict[str, Any]]  # the input lines, with "prompt" set to the text the model sees
    requests: list[Request]
    samples_per_prompt: int
    chunk_prompts: int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory (with tokenizer)")
    p.add_argument("--input", required=True, help='JSONL: {"prompt": ...} or {"messages": [...]} per line')
    p.add_argument("--output", required=True, help="JSONL written in input order")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per replica")
    p.add_argument("--max-new-tokens", type=int, default=256, help="completion length limit")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed gives the same tokens")
    p.add_argument("--samples-per-prompt", type=int, default=1, help="completions per prompt")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="context limit for prompt + completion; sizes each KV slot (default: the longest "
                        "prompt plus --max-new-tokens, within the model's limit)")
    p.add_argument("--max-batch-size", type=int, default=256, help="requests decoded at once per replica")
    p.add_argument("--kv-block-size", type=int, default=64,
                   help="tokens per KV cache block: the cache holds the blocks requests reach (0: one contiguous "
                        "block of --max-seq-len per request)")
    p.add_argument("--chunk-prompts", type=int, default=1024, help="prompts per chunk written together")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="compute dtype (auto: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--compile", action="store_true", help="torch.compile the decode step (GPU, tp=1)")
    p.add_argument("--compile-mode", choices=COMPILE_MODES, default="default",
                   help="torch.compile mode of the decode step with --compile (max-autotune-no-cudagraphs: "
                        "autotuned kernels, much longer compilation)")
    p.add_argument("--blas-library", choices=BLAS_LIBRARIES, default=None,
                   help="BLAS library of the decode step's products (GPU; default: torch's)")
    p.add_argument("--transposed-weights", action="store_true",
                   help="decode products read their weights stored transposed (GPU; other cuBLAS kernels, "
                        "for a copy of o, down and the LM head)")


def run(args: argparse.Namespace) -> None:
    job = prepare(args)
    layout = Layout.parse(job.layout)
    launch(_rank_main, layout.size, job)


# ----- reading and checking, before any rank starts -----------------------------------------------

def prepare(args: argparse.Namespace) -> Job:
    model = Path(args.model)
    cfg = ModelConfig.from_pretrained(model)
    if args.dp < 1 or args.tp < 1:
        raise ValueError(f"--dp and --tp must be positive, got dp={args.dp} tp={args.tp}")
    layout = Layout.contiguous(dp=args.dp, tp=args.tp)
    check_layout(cfg, layout)
    if cfg.value_head:
        raise ValueError(f"{model} is a value model ({cfg.architecture}); it cannot generate")
    if args.blas_library is not None and not torch.cuda.is_available():
        raise ValueError(f"--blas-library {args.blas_library} needs a GPU; this machine has none")
    if args.transposed_weights and not torch.cuda.is_available():
        raise ValueError("--transposed-weights needs a GPU; this machine has none")
    if args.samples_per_prompt < 1 or args.chunk_prompts < 1:
        raise ValueError("--samples-per-prompt and --chunk-prompts must be positive")
    limit = args.max_seq_len or cfg.max_position_embeddings
    if limit > cfg.max_position_embeddings:
        raise ValueError(f"--max-seq-len {limit} exceeds the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings})")
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)


    tokenizer = AutoTokenizer.from_pretrained(model)
    records, prompts = read_prompts(Path(args.input), tokenizer, limit)
    requests = make_requests(prompts, params, args.samples_per_prompt)
    # A request holds at most max_seq_len positions: no more than the longest request can use.
    max_seq_len = min(limit, max(len(p) for p in prompts) + args.max_new_tokens)
    engine = EngineConfig(max_seq_len=max_seq_len, max_batch_size=args.max_batch_size, compile=args.compile,
                          compile_mode=args.compile_mode, blas_library=args.blas_library,
                          transposed_weights=args.transposed_weights, kv_block_size=args.kv_block_size or None)
    return Job(model=str(model), layout=str(layout), output=args.output, dtype=args.dtype, engine=engine,
               records=records, requests=requests, samples_per_prompt=args.samples_per_prompt,
               chunk_prompts=args.chunk_prompts)


def read_prompts(path: Path, tokenizer, max_seq_len: int) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """Parse, render and tokenize every line; ValueError naming the line on the first bad one."""
    if not path.is_file():
        raise FileNotFoundError(f"no input file {path}")
    records, prompts = [], []
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
                raise ValueError(f'{where}: expected an object with either "prompt" or "messages"')
            text = prompt_text(record, tokenizer, where)
            ids = tokenizer(text, add_special_tokens="messages" not in record)["input_ids"]
            if not ids:
                raise ValueError(f"{where}: the prompt has no tokens")
            if len(ids) >= max_seq_len:
                raise ValueError(f"{where}: the prompt has {len(ids)} tokens; the context holds {max_seq_len} "
                                 "(prompt and completion together), so it leaves no room to generate")
            records.append({**record, "prompt": text})
            prompts.append(ids)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return records, prompts


def prompt_text(record: dict[str, Any], tokenizer, where: str) -> str:
    if "prompt" in record:
        prompt = record["prompt"]
        if not isinstance(prompt, str):
            raise ValueError(f'{where}: "prompt" must be a string, got {type(prompt).__name__}')
        if not prompt:
            raise ValueError(f"{where}: empty prompt")
        return prompt
    messages = record["messages"]
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)):
        raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
    if not tokenizer.chat_template:
        raise ValueError(f"{where}: the tokenizer has no chat template to render messages with")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


# ----- on every rank ------------------------------------------------------------------------------

def _rank_main(world, job: Job) -> None:
    layout = Layout.parse(job.layout)
    world.create_groups([layout])
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        job.dtype, torch.bfloat16 if world.device.type == "cuda" else torch.float32)
    model, _ = load_model(job.model, layout, world, dtype=dtype)
    writer = None
    if world.rank == layout.ranks[0]:
        writer = OutputWriter(job)
    engine = GenerationEngine(model, job.engine, eos_token_ids=eos_token_ids(job.model, model.cfg))
    try:
        groups = job.chunk_prompts * job.samples_per_prompt
        for start in range(0, len(job.requests), groups):
            chunk = job.requests[start: start + groups]
            done = generate_replicated(engine, layout, world, chunk,
                                       on_finish=writer.progress if writer else None)
            if writer is not None:
                writer.write(done)
    finally:
        if writer is not None:
            writer.close()


def eos_token_ids(model_dir: str, cfg: ModelConfig) -> tuple[int, ...]:
    """EOS ids from generation_config.json (what ``transformers`` generate uses), else config.json."""
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        if value is not None:
            return tuple(value) if isinstance(value, list) else (int(value),)
    return cfg.eos_token_ids


class OutputWriter:
    """Writes finished chunks in input order, flushed at once, with a progress bar."""

    def __init__(self, job: Job):
        self.job = job
        self.tokenizer = AutoTokenizer.from_pretrained(job.model)
        self.file: TextIO = open(job.output, "w")
        self.bar = tqdm(total=len(job.requests), unit="seq", desc="generate", dynamic_ncols=True)
        self.start, self.tokens, self.done = time.perf_counter(), 0, 0

    def progress(self, request: Request) -> None:
        """A request of this rank's own replica finished (the others report per chunk)."""
        self.bar.update(1)

    def write(self, requests: list[Request]) -> None:
        for r in requests:
            line = output_line(self.job.records[r.group], r, self.tokenizer, r.request_id % self.job.samples_per_prompt)
            self.file.write(json.dumps(line, ensure_ascii=False) + "\n")
            self.tokens += len(r.output_ids)
        self.file.flush()
        self.done += len(requests)
        self.bar.update(self.done - self.bar.n)

    def close(self) -> None:
        self.bar.close()
        self.file.close()
        seconds = time.perf_counter() - self.start
        logger.info(f"wrote {self.done} completions ({self.tokens} tokens) to {self.job.output} in {seconds:.1f}s "
              f"({self.tokens / max(seconds, 1e-9):.1f} tokens/s)")


def output_line(record: dict[str, Any], r: Request, tokenizer, sample: int) -> dict[str, Any]:
    return {
        **record,
        "sample": sample,
        "completion": tokenizer.decode(r.output_ids, skip_special_tokens=True),
        "completion_ids": r.output_ids,
        "logprobs": r.output_logprobs,
        "finish_reason": r.finish_reason,
    }
