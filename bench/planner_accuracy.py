"""How close the planner's call-time estimates come to measured times on this machine.

It profiles one model shape (the same measurements as ``shardflow profile``, tp = 1, eager layers), then times,
on one device with random weights, the single-device versions of the three kinds of call:
- inference: forward over micro-batches and per-token log-probabilities,
- training: forward + backward over micro-batches, then AdamW over fp32 master weights,
- generation: a plain decode loop (prefill, then one token per step for every request, static
  KV cache, the engine's decode attention, greedy), every request running to the same length,
and compares each with the cost model's estimate from the profile measured in the same run.

    python bench/planner_accuracy.py --out OUT            # Qwen3-1.7B shape, bf16, on the GPU
    python bench/planner_accuracy.py --out OUT --tiny     # a tiny shape on CPU (a smoke test)

Prints a table and writes OUT/planner_accuracy.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardflow.config.model import ModelConfig  # noqa: E402
from shardflow.engine.generate.decode_attention import ATTENTION  # noqa: E402
from shardflow.models.transformer import build_model  # noqa: E402
from shardflow.parallel.layout import Layout  # noqa: E402
from shardflow.parallel.sharding import shard_for  # noqa: E402
from shardflow.perf.hardware import Cluster  # noqa: E402
from shardflow.perf.profile import OpCosts  # noqa: E402
from shardflow.plan.cost import CostModel  # noqa: E402
from shardflow.plan.workload import Workload  # noqa: E402
from shardflow.profiler.measure import QUICK, Grid, profile_model, timed  # noqa: E402

QWEN3_1_7B = {
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "hidden_act": "silu",
}
TINY = {**QWEN3_1_7B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}

# (sequences, tokens per sequence, micro-batches) and (batch, prompt tokens, new tokens)
GPU_CASES = {
    "inference": [(64, 1024, 4), (32, 2048, 8), (16, 4096, 16)],
    "train": [(32, 1024, 8), (16, 2048, 4)],
    "generate": [(1, 256, 256), (32, 512, 256), (128, 1024, 128)],
}
TINY_CASES = {"inference": [(8, 32, 2)], "train": [(4, 32, 2)], "generate": [(2, 16, 8)]}
GPU_GRID = Grid(tokens=(1024, 4096, 8192, 16384, 32768), seqlens=(256, 1024, 4096),
                batches=(1, 8, 32, 128, 256), contexts=(256, 1024, 2048, 4096), head_tokens=(256, 1024, 4096, 16384))


def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
    layout = Layout((0,))
    model = build_model(cfg, shard_for(cfg, layout, 0), None, device, dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    return model


def batches(cfg, seqs: int, length: int, micro: int, device):
    per = seqs // micro
    ids = torch.randint(0, cfg.vocab_size, (micro, per, length), device=device)
    positions = torch.arange(length, device=device).expand(per, length)
    return [(ids[i], positions) for i in range(micro)]


def response_logprobs(model, ids: torch.Tensor, pos: torch.Tensor, prompt: int) -> torch.Tensor:
    """Log-probabilities [B, T - prompt] of the response tokens, the head on the hidden states before
    them alone (as the runtime's RL calls run it)."""
    return model.token_logprobs(model(ids, pos)[:, prompt - 1:-1], ids[:, prompt:])


def measure_inference(model, cfg, seqs, length, micro, device) -> float:
    data = batches(cfg, seqs, length, micro, device)

    @torch.no_grad()
    def run():
        for ids, pos in data:
            response_logprobs(model, ids, pos, length // 2)

    return timed(run, device, 2)


def measure_train(model, cfg, seqs, length, micro, device) -> float:
    data = batches(cfg, seqs, length, micro, device)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-6, **({"fused": True} if device.type == "cuda" else {}))

    def step():
        for ids, pos in data:
            loss = -response_logprobs(model, ids, pos, length // 2).mean() / micro
            loss.backward()
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)

    return timed(step, device, 1)


class StaticCache:
    """Per-layer KV cache [B, kv_heads, max_len, head_dim]; ``pos`` is where the next tokens go."""

    def __init__(self, cfg, batch: int, max_len: int, device, dtype):
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.pos = 0
        self.gqa = cfg.num_heads != cfg.num_kv_heads
        self.slots = torch.arange(batch, device=device)
        self.decode = ATTENTION["triton" if torch.device(device).type == "cuda" else "torch"]

    def attend(self, layer: int, q, k, v):
        B, T = q.shape[0], q.shape[2]
        self.k[layer][:, :, self.pos:self.pos + T] = k
        self.v[layer][:, :, self.pos:self.pos + T] = v
        if T == 1:  # a decode step: the engine's decode attention, as the profile times it
            lengths = torch.full((B,), self.pos + 1, device=q.device)
            return self.decode(q[:, :, 0], self.k[layer], self.v[layer], self.slots, lengths, None)[:, :, None]
        keys, values = self.k[layer][:, :, :self.pos + T], self.v[layer][:, :, :self.pos + T]
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=self.gqa)


def measure_generate(model, cfg, batch, prompt, new, device, dtype) -> float:
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device=device)

    @torch.no_grad()
    def run():
        cache = StaticCache(cfg, batch, prompt + new, device, dtype)
        h = model(ids, torch.arange(prompt, device=device).expand(batch, prompt), cache.attend)
        token = model.logits(h[:, -1:]).argmax(-1)  # [B,1]
        cache.pos = prompt
        for step in range(new - 1):
            positions = torch.full((batch, 1), prompt + step, device=device)
            h = model(token, positions, cache.attend)
            cache.pos += 1
            token = model.logits(h).argmax(-1)

    return timed(run, device, 1, rounds=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for planner_accuracy.json")
    parser.add_argument("--tiny", action="store_true", help="tiny shape on CPU (smoke test)")
    parser.add_argument("--device", default=None, help="cuda | cpu (default: cuda when present, cpu with --tiny)")
    args = parser.parse_args()
    device = torch.device(args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = ModelConfig.from_hf_dict(TINY if args.tiny else QWEN3_1_7B)
    cases = TINY_CASES if args.tiny else GPU_CASES
    t0 = time.perf_counter()

    # the single-device calls below run eager layers, so the profile times eager layers too
    profile = profile_model(cfg, tps=(1,), grid=QUICK if args.tiny else GPU_GRID, device=device, dtype=dtype,
                            compile_layers=False)
    cluster = profile.cluster(Cluster(num_nodes=1, gpus_per_node=1))
    model = random_model(cfg, device, dtype)
    layout = Layout((0,))
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile.save(out / "profile.json")
    result = {"device": profile.device, "dtype": str(dtype), "model": "tiny" if args.tiny else "Qwen3-1.7B shape",
              "rates": profile.rates, "rows": rows}

    def save() -> None:  # after every case, so a run cut short keeps what it measured
        errors = [r["relative_error"] for r in rows]
        result.update(mean_relative_error=sum(errors) / len(errors) if errors else None,
                      worst_relative_error=max(errors, default=None), seconds=time.perf_counter() - t0)
        (out / "planner_accuracy.json").write_text(json.dumps(result, indent=1))
    for kind, items in cases.items():
        for item in items:
            if kind == "generate":
                batch, prompt, new = item
                w = Workload(prompts=batch, prompt_tokens=prompt, max_new_tokens=new, response_mean=new)
                estimated = CostModel(OpCosts(cluster, profile), w).generate(cfg, layout, batch)
                measured = measure_generate(model, cfg, batch, prompt, new, device, dtype)
                label = f"batch {batch}, prompt {prompt}, {new} new tokens"
            else:
                seqs, length, micro = item
                # every sequence `length` tokens: half prompt, half response, no spread
                w = Workload(prompts=seqs, prompt_tokens=length // 2, max_new_tokens=length - length // 2,
                             response_mean=length - length // 2)
                costs = CostModel(OpCosts(cluster, profile), w)
                if kind == "inference":
                    estimated = costs.inference(cfg, layout, micro)
                    measured = measure_inference(model, cfg, seqs, length, micro, device)
                else:
                    estimated = costs.train(cfg, layout, micro)
                    measured = measure_train(model, cfg, seqs, length, micro, device)
                label = f"{seqs} x {length} tokens, {micro} micro-batches"
            rows.append({"call": kind, "case": label, "measured_s": measured, "estimated_s": estimated,
                         "relative_error": abs(estimated - measured) / measured})
            print(f"{kind:9s}  {label:40s}  measured {measured:9.4f} s  estimated {estimated:9.4f} s  "
                  f"error {rows[-1]['relative_error']:6.1%}", flush=True)
            save()
    print(f"relative error: mean {result['mean_relative_error']:.1%}, worst {result['worst_relative_error']:.1%} "
          "(target under 20%)")
    print(f"wrote {out / 'planner_accuracy.json'} and {out / 'profile.json'}")


if __name__ == "__main__":
    main()
