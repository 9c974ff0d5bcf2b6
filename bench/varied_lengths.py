"""Training steps on batches whose lengths change from step to step, as RL's responses do: rows of
attention padded to multiples (the default on GPUs) against rows at their exact lengths.

    python bench/varied_lengths.py --out runs/bench-varied          # GPU: Qwen3-1.7B shape, 16 x 8 samples
    python bench/varied_lengths.py --out runs/bench-varied --tiny   # any machine: a tiny shape

cuDNN's attention builds a plan for every shape it has not met (``models.packed_attention``): a
micro-batch whose rows are exactly as long as its longest sequence is almost always a new shape
when lengths vary. On GPUs the engine pads rows to a multiple of ``LENGTH_MULTIPLE`` positions (and
the shared-prompt rows kernel's rows to a multiple of ``ROWS_MULTIPLE``), so shapes repeat. Each
step here trains on a new batch (``--prompts`` x ``--samples``, prompts of ``--prompt-tokens``,
responses drawn from ``--response-tokens`` MIN,MAX), with shared prompts and with padded rows,
under both rules; the same batches for both. Reported: the median step after ``--warmup`` steps
(the first steps build the common plans of either rule), and the tokens the layers ran.
Prints a table and writes ``varied_lengths.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from iteration import SHAPES  # noqa: E402
from shared_prompts import TINY_SHAPE, PolicyLoss, group_batch, one_rank  # noqa: E402

from shardflow.config.experiment import OptimConfig  # noqa: E402
from shardflow.engine import shared_prompts  # noqa: E402
from shardflow.engine.train.engine import TrainEngine  # noqa: E402
from shardflow.models import packed_attention  # noqa: E402
from shardflow.models.checkpoint import load_model  # noqa: E402


@contextlib.contextmanager
def exact_rows():
    """Rows of attention at their exact lengths (the engine before padding to multiples)."""
    saved = (shared_prompts.LENGTH_MULTIPLE, packed_attention.LENGTH_MULTIPLE, packed_attention.ROWS_MULTIPLE)
    shared_prompts.LENGTH_MULTIPLE = packed_attention.LENGTH_MULTIPLE = packed_attention.ROWS_MULTIPLE = 1
    try:
        yield
    finally:
        shared_prompts.LENGTH_MULTIPLE, packed_attention.LENGTH_MULTIPLE, packed_attention.ROWS_MULTIPLE = saved


def run(args, device: torch.device, dtype: torch.dtype, shape: dict, work: Path) -> dict:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**shape, rms_norm_eps=1e-6)
    config.architectures = ["Qwen3ForCausalLM"]
    with torch.device(device):
        AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(work / "model")
    world, layout = one_rank(device)
    model, _ = load_model(work / "model", layout, world, dtype=dtype)
    if device.type == "cuda":
        model.compile_layers()
    engine = TrainEngine(model, layout, world, OptimConfig(lr=1e-7))
    lo, hi = args.response_tokens
    batches = [group_batch(shape["vocab_size"], args.prompts, args.samples, (args.prompt_tokens,) * 2, (lo, hi),
                           seed=100 + i) for i in range(args.warmup + args.steps)]
    out = {}
    for share in (True, False):
        for rule, context in (("exact", exact_rows), ("multiples", contextlib.nullcontext)):
            times, tokens = [], []
            with context():
                for batch in batches:
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    metrics = engine.step(batch, PolicyLoss(), micro_batch_tokens=args.micro_batch_tokens,
                                          share_prompts=share)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                    tokens.append(metrics["model_tokens"])
            steady = times[args.warmup:]
            out[f"{'shared' if share else 'padded'}_{rule}"] = {
                "step_s": statistics.median(steady), "steps_s": times,
                "model_tokens": statistics.mean(tokens[args.warmup:])}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--response-tokens", type=lambda t: tuple(int(v) for v in t.split(",")), default=(128, 512),
                        metavar="MIN,MAX")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if len(args.response_tokens) != 2 or not 1 <= args.response_tokens[0] <= args.response_tokens[1]:
        parser.error(f"--response-tokens takes MIN,MAX with 1 <= MIN <= MAX, got {args.response_tokens}")
    if args.tiny:
        args.prompts, args.samples, args.prompt_tokens, args.response_tokens = 4, 4, 8, (4, 16)
        args.micro_batch_tokens, args.warmup, args.steps = 64, 1, 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = TINY_SHAPE if args.tiny else SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(args, device, dtype, shape, Path(tmp))
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "dtype": str(dtype), "args": vars(args), "steps": rows}
    (out / "varied_lengths.json").write_text(json.dumps(result, indent=2))
    print(f"\ntraining steps on new lengths each step: {args.prompts} prompts x {args.samples} samples, prompts of "
          f"{args.prompt_tokens} tokens, responses of {args.response_tokens[0]}-{args.response_tokens[1]} "
          f"({result['device']})")
    print("| rows | rows of attention | s/step (median after the first {}) | tokens through the layers |"
          .format(args.warmup))
    print("|---|---|---:|---:|")
    for name, row in rows.items():
        kind, rule = name.split("_")
        print(f"| {kind} | {'exact lengths' if rule == 'exact' else 'padded to multiples'} | {row['step_s']:.3f} | "
              f"{row['model_tokens']:.0f} |")


if __name__ == "__main__":
    main()
