"""Multi-turn rollouts: episodes that keep their KV between turns against re-prefilling the whole
history every turn, and the share of environment and reward time hidden behind decoding.

    python bench/multiturn.py --out runs/bench-multiturn          # GPU: Qwen3-1.7B shape, bf16
    python bench/multiturn.py --out runs/bench-multiturn --tiny   # any machine: a tiny shape

Random weights of the shape on one device. ``--episodes`` episodes of ``--turns`` turns; every
turn is forced to ``--turn-tokens`` tokens (EOS ignored) and every observation is
``--observation-tokens`` tokens after a ``--prompt-tokens`` prompt.

1. continuation: the engine's episodes (the history's KV stays in its slot; only the observation
   is prefilled) against the same episodes with the KV dropped at every turn's end (the whole
   history prefilled again, what an engine without continuation does). Greedy: in float32 both
   must give the same tokens (the script fails otherwise); in bf16 the two round the history's KV
   differently and their paths may part (the share of tokens before they do is reported). Each against its roofline: decode steps x (weights +
   mean KV bytes) / measured bandwidth, plus prefilled tokens x 2 x parameters / measured bf16
   matrix rate.
2. hidden share: the same episodes with their environments in a worker pool (``--workers``), each
   step taking ``--env-ms``, and a reward per episode taking ``--reward-ms``; the share of that
   time the rollout did not wait for, and the rollout's time against the one with instant
   environments and rewards.
Prints a table and writes ``multiturn.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from generation import measure_bandwidth, random_model, sync  # noqa: E402
from iteration import SHAPES  # noqa: E402

from shardflow.config.experiment import RewardConfig  # noqa: E402
from shardflow.config.model import ModelConfig  # noqa: E402
from shardflow.engine.generate.engine import EngineConfig, GenerationEngine  # noqa: E402
from shardflow.engine.generate.episodes import run_episodes  # noqa: E402
from shardflow.engine.generate.kv_cache import bytes_per_slot  # noqa: E402
from shardflow.engine.generate.requests import SamplingParams, make_requests  # noqa: E402
from shardflow.parallel.layout import Layout  # noqa: E402
from shardflow.parallel.sharding import shard_for  # noqa: E402
from shardflow.rl.envs import EnvSpec  # noqa: E402
from shardflow.rl.envs.chat import ObservationFormat  # noqa: E402
from shardflow.rl.envs.client import EpisodeClient, EpisodeLimits  # noqa: E402
from shardflow.rl.rewards.pooled import PooledRewards  # noqa: E402
from shardflow.rl.workers import WorkerPool  # noqa: E402

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=8192,
            tie_word_embeddings=True)


class CountingTokenizer:
    """Texts as one token per character, token ids as their count: random weights write no text."""

    chat_template = None

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return f"{len(ids)} tokens"

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [7] * len(text)}


class ScriptedTurns:
    """Every ended turn answered at once in this process: the engine alone is measured. With
    ``keep_kv=False`` each episode drops its KV at every turn's end (re-prefill)."""

    def __init__(self, turns: int, observation: int, keep_kv: bool):
        self.turns, self.observation, self.keep_kv, self.answers = turns, observation, keep_kv, []

    def begin(self, request, row):
        request.keep_kv = self.keep_kv

    def ended(self, r):
        self.answers.append((r.request_id, [7] * self.observation if r.turns < self.turns else None))

    def ready(self, wait):
        out, self.answers = self.answers, []
        return out


def qwen3_config(shape: dict) -> ModelConfig:
    from transformers import Qwen3Config

    hf = Qwen3Config(**shape, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    hf.architectures = ["Qwen3ForCausalLM"]
    return ModelConfig.from_hf_dict(hf.to_dict())


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square product (the prefill's roofline rate)."""
    n = 8192 if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 10 * 2 * n ** 3 / (time.perf_counter() - start)


def rollout(engine: GenerationEngine, args, turns, *, client=None, rewards=None) -> tuple[list, float]:
    prompts = [[5 + (i * 7 + j) % 400 for j in range(args.prompt_tokens)] for i in range(args.episodes)]
    requests = make_requests(prompts, SamplingParams(max_new_tokens=args.turn_tokens, temperature=0.0,
                                                     ignore_eos=True), 1)
    rows = [{"turns": args.turns, "observation_tokens": args.observation_tokens, "env_ms": args.env_ms}] * len(requests)

    def over(r):
        if rewards is not None:
            rewards.submit(r.request_id, "", "", args.reward_ms)

    engine.reset_cache()
    engine.stats.prefill_tokens = 0
    sync(engine.device)
    start = time.perf_counter()
    run_episodes(engine, requests, client if client is not None else turns, rows, share=lambda a: a,
                 max_output=args.turns * (args.turn_tokens + args.observation_tokens) + 1, on_finish=over)
    scores = rewards.collect() if rewards is not None else None
    sync(engine.device)
    seconds = time.perf_counter() - start
    engine.release_cache()
    return requests, seconds, scores


def roofline(cfg: ModelConfig, args, params: int, steps: int, prefill_tokens: int, bandwidth: float, rate: float,
             dtype: torch.dtype) -> float:
    """Decode steps at weights + mean KV bytes per step over the bandwidth, plus prefill at the
    matrix rate."""
    item = torch.empty((), dtype=dtype).element_size()
    kv_per_token = bytes_per_slot(shard_for(cfg, Layout((0,)), 0), cfg, 1, dtype)
    total = args.prompt_tokens + args.turns * (args.turn_tokens + args.observation_tokens)
    mean_context = (args.prompt_tokens + total) / 2
    decode = steps * (params * item + args.episodes * mean_context * kv_per_token) / bandwidth
    return decode + prefill_tokens * 2 * params / rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--episodes", type=int, default=None)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--turn-tokens", type=int, default=None)
    parser.add_argument("--observation-tokens", type=int, default=None)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--env-ms", type=float, default=20.0)
    parser.add_argument("--reward-ms", type=float, default=20.0)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.tiny or device.type != "cuda"
    args.episodes = args.episodes or (8 if tiny else 64)
    args.prompt_tokens = args.prompt_tokens or (32 if tiny else 512)
    args.turn_tokens = args.turn_tokens or (16 if tiny else 256)
    args.observation_tokens = args.observation_tokens or (16 if tiny else 256)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TINY if tiny else SHAPES["qwen3-1.7b"]
    cfg = qwen3_config(shape)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, dtype=str(dtype), shape=shape,
                  settings={k: v for k, v in vars(args).items() if k != "out"})
    bandwidth = measure_bandwidth(device, 4.0 if device.type == "cuda" else 0.25)
    rate = matmul_rate(device, dtype)
    report.update(bandwidth_gbs=bandwidth / 1e9, matmul_tflops=rate / 1e12)
    model = random_model(cfg, device, dtype)
    params = sum(p.numel() for p in model.parameters())
    max_len = args.prompt_tokens + args.turns * (args.turn_tokens + args.observation_tokens) + 2
    engine = GenerationEngine(model, EngineConfig(max_batch_size=args.episodes, max_seq_len=max_len,
                                                  max_prefill_tokens=16384), eos_token_ids=())

    # 1. continuation against re-prefill
    tokens = {}
    for name, keep in (("continued", True), ("re-prefilled", False)):
        turns = ScriptedTurns(args.turns, args.observation_tokens, keep)
        rollout(engine, args, turns)  # warm-up: graphs, compilation
        times, prefill = [], 0
        for _ in range(args.repeat):
            requests, seconds, _ = rollout(engine, args, turns)
            times.append(seconds)
            prefill = engine.stats.prefill_tokens
        steps = args.turns * args.turn_tokens
        tokens[name] = [r.output_ids for r in requests]
        limit = roofline(cfg, args, params, steps, prefill, bandwidth, rate, dtype)
        report[name] = dict(seconds=statistics.median(times), prefill_tokens=prefill, roofline_s=limit,
                            vs_roofline=statistics.median(times) / limit)
    report["same_tokens"] = tokens["continued"] == tokens["re-prefilled"]
    # in bf16 the KV written token by token and the one prefilled at once round differently, and
    # random weights' near-ties then part greedy paths: the share of tokens before they part
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))) / max(len(x), 1)
             for x, y in zip(tokens["continued"], tokens["re-prefilled"])]
    report["tokens_before_parting"] = statistics.mean(agree)
    report["speedup"] = report["re-prefilled"]["seconds"] / report["continued"]["seconds"]

    # 2. environments and rewards beside decoding
    spec = EnvSpec("bench_envs:SleepyEnv")
    limits = EpisodeLimits(max_turns=args.turns, max_output=max_len, max_seq_len=max_len, timeout_s=60)
    with WorkerPool(args.workers) as pool:
        for name, env_ms, reward_ms in (("instant", 0.0, 0.0), ("slow", args.env_ms, args.reward_ms)):
            args.env_ms, args.reward_ms = env_ms, reward_ms
            times, hidden = [], []
            for i in range(args.repeat + 1):  # the first warms the workers up (imports)
                client = EpisodeClient(pool, spec, ObservationFormat(CountingTokenizer(), "tool", chat=False),
                                       CountingTokenizer(), limits)
                rewards = PooledRewards(pool, RewardConfig(kind="function", function="bench_envs:sleepy_reward"))
                _, seconds, scores = rollout(engine, args, None, client=client, rewards=rewards)
                busy = sum(e.seconds for e in client.episodes.values()) + scores.seconds
                if i:
                    times.append(seconds)
                    hidden.append(1 - (client.waited + scores.waited) / busy if busy > 0 else 1.0)
            report[f"pool_{name}"] = dict(seconds=statistics.median(times), hidden_share=statistics.median(hidden),
                                          env_ms=env_ms, reward_ms=reward_ms)
        args.env_ms, args.reward_ms = report["pool_slow"]["env_ms"], report["pool_slow"]["reward_ms"]
    work = args.episodes * (args.turns * args.env_ms + args.reward_ms) / 1000 / args.workers
    report["pool_slow"]["work_per_worker_s"] = work
    report["pool_slow"]["extra_s"] = report["pool_slow"]["seconds"] - report["pool_instant"]["seconds"]

    (out / "multiturn.json").write_text(json.dumps(report, indent=1))
    print(f"{report['device']}, {args.episodes} episodes x {args.turns} turns x {args.turn_tokens} tokens, "
          f"observations {args.observation_tokens}, prompt {args.prompt_tokens}")
    print(f"{'':14}{'seconds':>9}{'prefilled':>11}{'roofline s':>12}{'x roofline':>11}")
    for name in ("continued", "re-prefilled"):
        r = report[name]
        print(f"{name:14}{r['seconds']:9.3f}{r['prefill_tokens']:11d}{r['roofline_s']:12.3f}{r['vs_roofline']:11.2f}")
    print(f"continuation {report['speedup']:.2f}x faster, same tokens: {report['same_tokens']} "
          f"({100 * report['tokens_before_parting']:.0f}% of each episode's tokens before the two part)")
    p = report["pool_slow"]
    print(f"pool of {args.workers}: env {args.env_ms:g} ms/step, reward {args.reward_ms:g} ms/episode "
          f"({p['work_per_worker_s']:.2f} s per worker): rollout {p['seconds']:.3f} s vs "
          f"{report['pool_instant']['seconds']:.3f} s instant, hidden share {p['hidden_share']:.2f}")
    if not report["same_tokens"] and dtype == torch.float32:
        sys.exit("continued episodes and re-prefilled ones gave different tokens in float32")


if __name__ == "__main__":
    main()
