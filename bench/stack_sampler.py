"""Run a Python module with a thread that samples every thread's stack, for where a process's wall time
goes when no profiler can attach (cold compilation, setup, first calls).

    python bench/stack_sampler.py --out stacks.json --interval 0.01 -m shardflow.cli.main train run.yaml
    python bench/stack_sampler.py --report stacks.json [--thread MainThread] [--from 10 --to 40] [--depth 3]

The samples are taken between bytecodes (the sampler needs the GIL): each stands for the time since the
thread's previous sample, so a C call that holds the GIL is charged to the stack found right after it.
``--report`` prints one thread's time by activity (imports, dynamo, inductor, Triton, graph capture), by
shardflow frame (inclusive), by the library frames below shardflow's innermost one and by innermost frame, and
a timeline of its dominant shardflow frame and activity per second. Samples may be gzipped (``.gz``).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import runpy
import sys
import threading
import time


class Sampler:
    def __init__(self, interval: float):
        self.interval, self.start = interval, time.perf_counter()
        self.frames: dict[tuple, int] = {}   # (file, function, line) -> id
        self.stacks: dict[tuple, int] = {}   # tuple of frame ids, outermost first -> id
        self.samples: list[tuple[float, str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def _frame(self, f) -> int:
        key = (f.f_code.co_filename, f.f_code.co_name, f.f_lineno)
        return self.frames.setdefault(key, len(self.frames))

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            now = time.perf_counter() - self.start
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = []
                while frame is not None:
                    stack.append(self._frame(frame))
                    frame = frame.f_back
                key = tuple(reversed(stack))
                self.samples.append((now, names.get(ident, str(ident)), self.stacks.setdefault(key, len(self.stacks))))

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def write(self, path: str) -> None:
        frames = [list(k) for k, _ in sorted(self.frames.items(), key=lambda kv: kv[1])]
        stacks = [list(k) for k, _ in sorted(self.stacks.items(), key=lambda kv: kv[1])]
        with open(path, "w") as f:
            json.dump({"interval": self.interval, "frames": frames, "stacks": stacks,
                       "samples": self.samples}, f)


# what a sample is doing, by the first of these found in its stack (innermost first)
ACTIVITIES = [("triton/compiler", "Triton compiling"), ("torch/_inductor/codecache", "inductor's caches and builds"),
              ("torch/_inductor/async_compile", "inductor waiting on its compile workers"),
              ("torch/_inductor", "inductor lowering and code generation"),
              ("torch/_functorch/_aot_autograd", "AOTAutograd"), ("torch/_dynamo", "dynamo tracing"),
              ("torch/cuda/graphs.py", "CUDA graph capture"), ("safetensors", "reading weights"),
              ("importlib", "imports"), ("torch/optim", "the optimizer")]


def _activity(stack: list) -> str:
    for frame in reversed(stack):
        for marker, name in ACTIVITIES:
            if marker in frame[0]:
                return name
    return "other"


def _label(frame: list) -> str:
    file, func, line = frame
    for marker in ("/shardflow/", "/site-packages/", "/dist-packages/", "/lib/python3"):
        if marker in file:
            file = file.split(marker, 1)[1]
            break
    return f"{file}:{func}:{line}"


def report(path: str, thread: str, start: float, end: float, depth: int, top: int) -> None:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        data = json.load(f)
    frames, stacks, interval = data["frames"], data["stacks"], data["interval"]
    # Each sample stands for the time since the thread's previous one: a sampler kept from the GIL (a long C
    # call that holds it) comes late, and the stack it then finds is most likely the one that kept it.
    ordered = sorted((t, s) for t, name, s in data["samples"] if name == thread)
    weighted = [(t, s, t - before) for (before, _), (t, s) in zip([(ordered[0][0] - interval, None), *ordered],
                                                                  ordered)] if ordered else []
    samples = [(t, s, w) for t, s, w in weighted if start <= t <= end]
    total = sum(w for _, _, w in samples)
    print(f"{len(samples)} samples of {thread}, {total:.1f} s, between {start:g} and "
          f"{min(end, samples[-1][0] if samples else 0):.1f} s (every {interval * 1e3:.0f} ms or later)")
    inclusive, own, activity = collections.Counter(), collections.Counter(), collections.Counter()
    library = collections.Counter()  # the outermost frame of each library that a shardflow frame called
    for _, s, weight in samples:
        stack = [frames[i] for i in stacks[s]]
        seen = set()
        for fr in stack:
            if "/shardflow/" in fr[0] or "/bench/" in fr[0]:
                key = _label([fr[0], fr[1], 0])
                if key not in seen:
                    seen.add(key)
                    inclusive[key] += weight
        ours = [i for i, fr in enumerate(stack) if "/shardflow/" in fr[0]]
        if ours and ours[-1] + 1 < len(stack):
            below = stack[ours[-1] + 1: ours[-1] + 1 + depth]
            library[" > ".join(_label(fr) for fr in [stack[ours[-1]], *below])] += weight
        if stack:
            own[_label(stack[-1])] += weight
        activity[_activity(stack)] += weight
    for title, counter in (("activities", activity), ("shardflow frames, inclusive", inclusive),
                           ("below shardflow's innermost frame", library), ("innermost frames", own)):
        print(f"\n{title} (s):")
        for key, seconds in counter.most_common(top):
            print(f"  {seconds:8.2f}  {key}")
    print("\ntimeline (s: shardflow's innermost frame and activity holding most of that second):")
    by_second = collections.defaultdict(collections.Counter)
    for t, s, weight in samples:
        stack = [frames[i] for i in stacks[s]]
        ours = [fr for fr in stack if "/shardflow/" in fr[0]]
        where = _label([ours[-1][0], ours[-1][1], 0]) if ours else "(outside shardflow)"
        by_second[int(t)][f"{where} [{_activity(stack)}]"] += weight
    for second in sorted(by_second):
        key, seconds = by_second[second].most_common(1)[0]
        print(f"  {second:5d}  {seconds:4.2f}  {key}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="where the samples go (JSON)")
    parser.add_argument("--interval", type=float, default=0.01, help="seconds between samples")
    parser.add_argument("--report", metavar="SAMPLES", help="summarise a file of samples instead of running")
    parser.add_argument("--thread", default="MainThread")
    parser.add_argument("--from", dest="start", type=float, default=0.0)
    parser.add_argument("--to", dest="end", type=float, default=float("inf"))
    parser.add_argument("--depth", type=int, default=2, help="library frames shown below shardflow's innermost")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("-m", dest="module", help="the module to run, then its arguments")
    args, rest = parser.parse_known_args()
    if args.report:
        report(args.report, args.thread, args.start, args.end, args.depth, args.top)
        return
    if not (args.out and args.module):
        parser.error("give --out and -m MODULE [ARGS...] (or --report SAMPLES)")
    sys.argv = [args.module, *rest]
    sampler = Sampler(args.interval)
    try:
        with sampler:
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    finally:
        sampler.write(args.out)


if __name__ == "__main__":
    main()
