"""``shardflow demo``: a tiny random checkpoint split over CPU ranks as pp=2 x tp=2.

It shows what each rank holds, then scores and greedily continues a prompt through the
pipeline (full recompute per token) and checks both against ``transformers``.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from shardflow.engine.inference import hidden_states
from shardflow.models.checkpoint import load_model
from shardflow.models.tiny import make_tiny_checkpoint
from shardflow.parallel import comm
from shardflow.parallel.launch import launch
from shardflow.parallel.layout import Layout

logger = logging.getLogger(__name__)

PROMPT = "shardflow splits models: "
NEW_TOKENS = 12


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/demo", help="directory for the tiny checkpoint")
    p.add_argument("--nprocs", type=int, default=4, help="ranks to spawn (4 gives pp=2 x tp=2)")


def run(args: argparse.Namespace) -> None:
    run_demo(args.out, nprocs=args.nprocs)


def run_demo(out: str, nprocs: int = 4) -> None:
    path = Path(out) / "tiny-llama"
    if not (path / "config.json").is_file():
        make_tiny_checkpoint(path, "llama", num_hidden_layers=4)
    pp = 2 if nprocs % 2 == 0 else 1
    layout = Layout(tuple(range(nprocs)), pp=pp, tp=nprocs // pp)
    launch(_demo_rank, nprocs, str(path), str(layout), backend="gloo")


def _demo_rank(world, path: str, layout_text: str) -> None:
    layout = Layout.parse(layout_text)
    world.create_groups([layout])
    model, shard = load_model(path, layout, world)
    held = sum(p.numel() for p in model.parameters())
    line = (f"rank {world.rank}: stage {shard.stage} layers {list(shard.layers)} tp {shard.tp_rank}/{layout.tp} "
            f"holds {len(shard.tensors)} tensors, {held} parameters")
    lines = [None] * world.size
    dist.all_gather_object(lines, line)

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tokenizer.encode(PROMPT, add_special_tokens=False)])
    last_rank = layout.rank_at(layout.pp - 1, 0, 0)
    group = world.groups.get(layout.ranks)

    ours_lp = None
    for step in range(NEW_TOKENS):
        positions = torch.arange(ids.shape[1])[None]
        hidden = hidden_states(model, layout, world, [(ids, positions)])
        token = torch.zeros(1, dtype=torch.long)
        if shard.last_stage:
            h = hidden[0]
            if step == 0:
                ours_lp = model.token_logprobs(h[:, :-1], ids[:, 1:])
            logits = comm.all_gather(model.logits(h[:, -1]), model.tp_group)
            token[0] = int(logits.argmax(-1))
        dist.broadcast(token, src=last_rank, group=group)
        ids = torch.cat([ids, token[None]], dim=1)

    if world.rank == last_rank:
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        prompt = ids[:, : ids.shape[1] - NEW_TOKENS]
        with torch.no_grad():
            ref_lp = torch.log_softmax(ref(prompt).logits[:, :-1], -1).gather(-1, prompt[:, 1:, None]).squeeze(-1)
            ref_ids = ref.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)
        logger.info(f"layout {layout}: {layout.pp} pipeline stages x {layout.tp} tensor-parallel shards")
        for text in lines:
            logger.info("  " + text)
        diff = (ours_lp - ref_lp).abs().max().item()
        logger.info(f"prompt log-prob: {ours_lp.sum().item():.4f} (transformers {ref_lp.sum().item():.4f}, "
              f"max per-token difference {diff:.1e})")
        same = torch.equal(ids, ref_ids)
        logger.info(f"greedy continuation: {tokenizer.decode(ids[0, prompt.shape[1]:])!r} "
              f"({'identical to' if same else 'DIFFERS from'} transformers)")
        if not same or diff > 1e-4:
            raise RuntimeError("sharded model disagrees with transformers")
