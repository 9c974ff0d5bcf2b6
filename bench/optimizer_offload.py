"""The offloaded AdamW step (state in pinned host memory, streamed in chunks) against the same step
with the state on the device, and against the host link's limit.

    python bench/optimizer_offload.py --out runs/bench-offload            # GPU: 512M parameters
    python bench/optimizer_offload.py --out runs/bench-offload --tiny     # any machine

A step moves the master weights and both moments (12 bytes per parameter) in and out; the two
directions run at once on their own copy streams, so the floor is the slower direction's bytes
over its bandwidth, measured here on pinned buffers. On the device the floor is the fused update's
bytes (34 a parameter, the bf16 weights' store included) over the device's copy bandwidth. The two
steps must give bitwise equal master weights (the same kernel). Prints a table and writes
``optimizer_offload.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shardflow.config.experiment import OptimConfig  # noqa: E402
from shardflow.engine.train.optimizer import AdamW  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeat: int) -> float:
    fn()
    sync(device)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def link_bandwidth(device: torch.device, nbytes: int) -> tuple[float, float]:
    """(host to device, device to host) bytes/s of one pinned copy."""
    if device.type != "cuda":
        return float("nan"), float("nan")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = nbytes / timed(lambda: dev.copy_(host, non_blocking=True), device, 5)
    d2h = nbytes / timed(lambda: host.copy_(dev, non_blocking=True), device, 5)
    return h2d, d2h


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second read and written by one device-to-device copy (each byte counted twice)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), device, 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--params", type=int, default=512 << 20)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = 1 << 16 if args.tiny else args.params
    cfg = OptimConfig(lr=1e-3, weight_decay=0.1)
    g = torch.Generator(device=device).manual_seed(0)
    start = torch.randn(n, device=device, generator=g)
    decay = [(0, n // 2)]
    chunk = 1 << 12 if args.tiny else 1 << 24
    resident = AdamW(start.clone(), decay, cfg)
    offloaded = AdamW(start.clone(), decay, cfg, offload=True, device=device, chunk_numel=chunk)
    del start
    grads = [torch.randn(n, device=device, generator=g) * 1e-2 for _ in range(2)]
    weights = torch.empty(n, dtype=torch.bfloat16, device=device)

    def store(lo, hi, values):
        weights[lo:hi].copy_(values)

    for step, grad in enumerate(grads, start=1):
        resident.step(grad, cfg.lr, step, store)
        offloaded.step(grad, cfg.lr, step, store)
    sync(device)
    equal = bool(torch.equal(resident.master.cpu(), offloaded.master)
                 and torch.equal(resident.exp_avg_sq.cpu(), offloaded.exp_avg_sq))

    counter = iter(range(3, 10**6))
    on_device = timed(lambda: resident.step(grads[0], cfg.lr, next(counter), store), device, args.repeat)
    streamed = timed(lambda: offloaded.step(grads[0], cfg.lr, next(counter), store), device, args.repeat)
    h2d, d2h = link_bandwidth(device, min(12 * n, 4 << 30))
    floor = max(12 * n / h2d, 12 * n / d2h)
    # on the device: master weights and both moments read and written, the gradient read (28 bytes a
    # parameter), then the new weights read and stored in bf16 (6 bytes)
    copy = copy_bandwidth(device, min(4 * n, 2 << 30))
    device_floor = 34 * n / copy
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "params": n, "chunk_numel": chunk, "bitwise_equal": equal, "on_device_step_s": on_device,
              "offloaded_step_s": streamed, "copy_gb_s": copy / 1e9, "on_device_floor_s": device_floor,
              "on_device_over_floor": on_device / device_floor, "h2d_gb_s": h2d / 1e9, "d2h_gb_s": d2h / 1e9,
              "link_floor_s": floor, "offloaded_over_floor": streamed / floor}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "optimizer_offload.json").write_text(json.dumps(result, indent=2))
    print(f"\nAdamW step, {result['device']}, {n / 1e6:.0f}M parameters (state {12 * n / 1e9:.1f} GB)")
    print("| state | s/step | floor s | x floor |")
    print("|---|---:|---:|---:|")
    print(f"| on the device | {on_device:.4f} | {device_floor:.4f} | {on_device / device_floor:.2f} |")
    print(f"| host, streamed | {streamed:.3f} | {floor:.3f} | {streamed / floor:.2f} |")
    print(f"host link: {h2d / 1e9:.1f} GB/s in, {d2h / 1e9:.1f} GB/s out (pinned); device copy {copy / 1e9:.0f} GB/s; "
          f"bitwise equal: {equal}")
    if not equal:
        raise SystemExit("the offloaded step differs from the on-device step")


if __name__ == "__main__":
    main()
