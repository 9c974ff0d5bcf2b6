"""One benchmark on several commits' trees (or settings), in turn, on one machine: paired figures for a change.

A change's effect on a GPU is often smaller than the spread from machine to machine, so its
before and after are measured in one call. Here, in the checkout (git needed):

    python bench/paired.py prepare --trees 424435d,3767c62

exports each commit's tree into ``_trees/REV/`` (ignored by git: ``.git/info/exclude``) with this
checkout's ``bench/`` copied over it, so that every tree runs the same measuring code. On the
measuring machine (``_trees`` carried along), the checkout itself (``head``), each tree, and each
``--variant NAME:VAR=VALUE[,VAR=VALUE]`` (the checkout with those environment variables set) and each
``--variant-args 'NAME:ARGS'`` (the checkout with ARGS after the script's arguments, e.g. a setting's
``--set``):

    python bench/paired.py run --out DIR --script shared_prompts.py --grep 'shared_rows|idle' --rounds 2 -- \\
        --skip-parity --cases shared_rows --profile

``--rounds N`` runs them all N times, in order in the first round, in reverse order in the second,
and so on (ABBA...), so that a machine that slows down or warms up during the call does not favour
whichever runs first. Each run gets empty compile caches of its own (inductor's cache keys sizes by
name, so a second run would reuse the first one's kernels), its output in ``DIR/NAME.log`` and its
``--out`` in ``DIR/NAME/`` (``NAME.rK`` with several rounds); the lines of each log matching
``--grep`` are printed, and ``paired.json`` lists the runs (name, round, tree, environment, exit
status, seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = "_trees"


def prepare(revisions: list[str], root: Path = ROOT) -> list[Path]:
    """``root/_trees/REV`` for each revision: its tree with ``root``'s bench/ over it."""
    exclude = root / ".git" / "info" / "exclude"
    if f"/{TREES}/" not in (exclude.read_text() if exclude.is_file() else ""):
        exclude.parent.mkdir(parents=True, exist_ok=True)
        with exclude.open("a") as f:
            f.write(f"\n/{TREES}/\n")
    made = []
    for rev in revisions:
        commit = subprocess.run(["git", "rev-parse", "--short", f"{rev}^{{commit}}"], cwd=root, check=True,
                                capture_output=True, text=True).stdout.strip()
        tree = root / TREES / commit
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", commit], cwd=root, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        shutil.copytree(root / "bench", tree / "bench", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
        made.append(tree)
    return made


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``NAME:VAR=VALUE[,VAR=VALUE]`` -> (NAME, {VAR: VALUE})."""
    name, sep, assignments = text.partition(":")
    pairs = [a.partition("=") for a in assignments.split(",") if a]
    if not sep or not name or name == "head" or not pairs or any(not var or not eq for var, eq, _ in pairs):
        raise ValueError(f"--variant {text!r}: expected NAME:VAR=VALUE[,VAR=VALUE] (NAME not 'head')")
    return name, {var: value for var, _, value in pairs}


def parse_variant_args(text: str) -> tuple[str, list[str]]:
    """``NAME:ARGS`` -> (NAME, ARGS split as a shell would)."""
    name, sep, rest = text.partition(":")
    try:
        extra = shlex.split(rest)
    except ValueError as e:
        raise ValueError(f"--variant-args {text!r}: {e}") from None
    if not sep or not name or name == "head" or not extra:
        raise ValueError(f"--variant-args {text!r}: expected NAME:ARGS (NAME not 'head', ARGS not empty)")
    return name, extra


def run(out: Path, script: str, args: list[str], grep: str | None, timeout: float, root: Path = ROOT,
        variants: list[tuple[str, dict[str, str]]] = (), rounds: int = 1,
        variant_args: list[tuple[str, list[str]]] = ()) -> list[dict]:
    """``bench/SCRIPT ARGS --out DIR/NAME`` in the checkout (NAME ``head``), in each prepared tree,
    in the checkout under each variant's environment and with each variant's arguments, ``rounds``
    times in alternating order."""
    candidates = ([("head", root, {}, [])] + [(t.name, t, {}, []) for t in sorted((root / TREES).glob("*"))
                                              if (t / "bench").is_dir()]
                  + [(n, root, e, []) for n, e in variants] + [(n, root, {}, a) for n, a in variant_args])
    names = [c[0] for c in candidates]
    if len(set(names)) != len(names):
        raise ValueError(f"run names repeat: {names}")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for r in range(rounds):
        for name, tree, extra_env, extra_args in candidates if r % 2 == 0 else candidates[::-1]:
            label = name if rounds == 1 else f"{name}.r{r + 1}"
            with tempfile.TemporaryDirectory() as caches:
                # set in the environment, these win over run.compile_cache too (engine.compile_cache)
                env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": f"{caches}/inductor",
                       "TRITON_CACHE_DIR": f"{caches}/triton", **extra_env}
                start = time.perf_counter()
                with (out / f"{label}.log").open("w") as log:
                    try:
                        code = subprocess.run([sys.executable, str(tree / "bench" / script), *args, *extra_args, "--out",
                                               str(out / label)], cwd=tree, env=env, stdout=log,
                                              stderr=subprocess.STDOUT, timeout=timeout).returncode
                    except subprocess.TimeoutExpired:
                        code = "timeout"
            rows.append({"name": name, "round": r + 1, "tree": str(tree.relative_to(root)) or ".", "env": extra_env,
                         "extra_args": extra_args, "returncode": code, "seconds": round(time.perf_counter() - start, 1)})
            # after every run, so that a call cut short keeps the runs it finished
            (out / "paired.json").write_text(json.dumps({"script": script, "args": args, "runs": rows}, indent=2) + "\n")
            print(f"== {label}: exit {code}, {rows[-1]['seconds']} s", flush=True)
            if grep:
                pattern = re.compile(grep)
                for line in (out / f"{label}.log").read_text(errors="replace").splitlines():
                    if pattern.search(line):
                        print(f"  {line}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="export commits' trees into _trees/ (run where git is)")
    p.add_argument("--trees", required=True, help="commits, comma-separated")
    r = sub.add_parser("run", help="run one benchmark in the checkout and in each prepared tree")
    r.add_argument("--out", required=True)
    r.add_argument("--script", required=True, help="a script of bench/, e.g. shared_prompts.py")
    r.add_argument("--grep", default=None, help="print the lines of each run's output that match this")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    r.add_argument("--variant", action="append", default=[],
                   help="NAME:VAR=VALUE[,VAR=VALUE]: also run the checkout with these environment variables")
    r.add_argument("--variant-args", action="append", default=[],
                   help="NAME:ARGS: also run the checkout with these arguments after the script's")
    r.add_argument("--rounds", type=int, default=1, help="run everything this many times, alternating the order")
    r.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments, after --")
    args = parser.parse_args()
    if args.command == "prepare":
        for tree in prepare([t for t in args.trees.split(",") if t]):
            print(f"prepared {tree.relative_to(ROOT)}")
        return
    if not (ROOT / "bench" / args.script).is_file():
        parser.error(f"no benchmark bench/{args.script}")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    try:
        variants = [parse_variant(v) for v in args.variant]
        variant_args = [parse_variant_args(v) for v in args.variant_args]
    except ValueError as e:
        parser.error(str(e))
    extra = args.args[1:] if args.args[:1] == ["--"] else args.args
    rows = run(Path(args.out), args.script, extra, args.grep, args.timeout, variants=variants, rounds=args.rounds,
               variant_args=variant_args)
    sys.exit(0 if all(r["returncode"] == 0 for r in rows) else 1)


if __name__ == "__main__":
    main()
