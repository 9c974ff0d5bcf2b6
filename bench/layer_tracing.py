"""What compiling a decoder layer over packed sequences costs in a new process: the layer as the
runtime compiles it (two graphs around the packed attention, ``models.transformer.LayerRunner``)
against one compiled function whose graph the packed attention breaks inside (the structure before).

    python bench/layer_tracing.py --out runs/bench-tracing                       # GPU: Qwen3-1.7B shape, inductor
    python bench/layer_tracing.py --out runs/bench-tracing --backend aot_eager   # tracing alone, no code generation
    python bench/layer_tracing.py --out runs/bench-tracing --tiny                # any machine: a tiny shape

Dynamo's work (tracing Python into graphs) is not cached between processes: every run pays it again
in its first iteration, cache or not. For each structure, after ``torch._dynamo.reset()``: the first
forward + backward over a packed micro-batch (a prompt and its samples), the first forward without
gradients, then a micro-batch of other sizes (which must compile nothing new); seconds of each, the
graphs made and the graph breaks, best of ``--repeats`` rounds. Both give the same outputs. Prints a
table and writes ``layer_tracing.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from iteration import SHAPES  # noqa: E402
from shared_prompts import TINY_SHAPE  # noqa: E402

from shardflow.config.model import ModelConfig  # noqa: E402
from shardflow.models.packed_attention import PackedSequences, packed_attention  # noqa: E402
from shardflow.models.transformer import DecoderLayer, LayerRunner  # noqa: E402
from shardflow.profiler.measure import one_layer_model  # noqa: E402


def _attention_with_break(layer: DecoderLayer, x, cos, sin, packed):
    q, k, v = layer.self_attn.project(x, cos, sin)
    return layer.self_attn.output(packed_attention(q[0], k[0], v[0], packed)[None])


def _layer_with_break(layer: DecoderLayer, x, cos, sin, attend, packed):
    """The structure before: one function, the packed attention (outside graphs) inside a nested call."""
    return layer.finish(x + _attention_with_break(layer, layer.input_layernorm(x), cos, sin, packed))


def packed_row(prompt: int, samples: int, own: int, device: torch.device) -> tuple[PackedSequences, torch.Tensor]:
    """A prompt of ``prompt`` tokens and ``samples`` samples of ``own`` tokens each, as one packed row:
    the sequences and each packed token's position."""
    kv, q_lens, k_lens, positions = [torch.arange(prompt)], [prompt], [prompt], [torch.arange(prompt)]
    for s in range(samples):
        start = prompt + s * own
        kv.append(torch.cat([torch.arange(prompt), torch.arange(start, start + own)]))
        q_lens.append(own)
        k_lens.append(prompt + own)
        positions.append(torch.arange(prompt, prompt + own))
    return PackedSequences.build(torch.cat(kv), q_lens, k_lens).to(device), torch.cat(positions).to(device)


def measure(run, model, cases, device) -> dict:
    layer = model.model.layers["0"]
    p = next(model.parameters())
    seconds = []
    outputs = []
    breaks, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
    for grad, (seqs, positions) in zip((True, False, True), cases):
        x = torch.randn(1, len(positions), model.cfg.hidden_size, device=device, dtype=p.dtype,
                        generator=torch.Generator(device).manual_seed(0), requires_grad=grad)
        cos, sin = model.rope(positions[None], p.dtype)
        start = time.perf_counter()
        with torch.set_grad_enabled(grad):
            out = run(layer, x, cos, sin, None, seqs)
            if grad:
                out.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        outputs.append(out.detach().float().cpu())
        model.zero_grad(set_to_none=True)
    return {"first_grad_s": seconds[0], "first_no_grad_s": seconds[1], "other_sizes_s": seconds[2],
            "graphs": counters["stats"]["unique_graphs"] - graphs,
            "graph_breaks": sum(counters["graph_break"].values()) - breaks, "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--backend", default=None, help="torch.compile backend (default: inductor on GPU, "
                                                         "aot_eager on CPU)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = args.backend or ("inductor" if device.type == "cuda" else "aot_eager")
    shape = TINY_SHAPE if args.tiny else SHAPES[args.shape]
    cfg = ModelConfig.from_hf_dict({**shape, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})
    model = one_layer_model(cfg, 1, device, dtype)
    sizes = ((4, 3, 5), (4, 3, 5), (6, 2, 9)) if args.tiny else ((64, 8, 512), (64, 8, 512), (200, 4, 1024))
    cases = [packed_row(*size, device) for size in sizes]
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    structures = {
        "two graphs (LayerRunner)": lambda: LayerRunner.compiled(dynamic=True, backend=backend),
        "one function, broken inside": lambda: torch.compile(_layer_with_break, dynamic=True, backend=backend),
    }
    measure(LayerRunner(), model, cases, device)  # the libraries' own first use, outside both
    rounds: dict[str, list[dict]] = {name: [] for name in structures}
    for _ in range(args.repeats):
        for name, make in structures.items():
            torch._dynamo.reset()
            rounds[name].append(measure(make(), model, cases, device))
    eager = measure(LayerRunner(), model, cases, device)["outputs"]
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "backend": backend, "shape": "tiny" if args.tiny else args.shape, "sizes": sizes, "structures": {}}
    for name, runs in rounds.items():
        best = {k: min(r[k] for r in runs) for k in ("first_grad_s", "first_no_grad_s", "other_sizes_s")}
        error = max((got - want).abs().max().item() for got, want in zip(runs[-1]["outputs"], eager))
        result["structures"][name] = {**best, "graphs": runs[-1]["graphs"], "graph_breaks": runs[-1]["graph_breaks"],
                                      "max_abs_diff_from_eager": error}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "layer_tracing.json").write_text(json.dumps(result, indent=2))
    print(f"compiling one decoder layer over packed sequences ({result['shape']}, {backend}, {result['device']})")
    print("| structure | first forward + backward s | first forward, no gradients s | other sizes s | graphs "
          "| graph breaks | max diff from eager |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in result["structures"].items():
        print(f"| {name} | {r['first_grad_s']:.2f} | {r['first_no_grad_s']:.2f} | {r['other_sizes_s']:.2f} | "
              f"{r['graphs']} | {r['graph_breaks']} | {r['max_abs_diff_from_eager']:.1e} |")


if __name__ == "__main__":
    main()
