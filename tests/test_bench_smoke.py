"""Each benchmark's CPU mode runs to the end and writes its JSON, so that a script broken by a
change is found here rather than on a GPU machine. (The figures are not checked: on a CPU they
mean nothing; bench/ and BENCHMARKS.md hold the measured ones.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"

CASES = {  # script: (arguments, JSON it writes)
    "generation.py": (["--tiny", "--skip-transformers"], "generation.json"),
    "decode_profile.py": (["--tiny"], "decode_profile.json"),
    "iteration.py": (["--tiny", "--iterations", "2", "--trl-steps", "2"], "iteration.json"),
    "train_step.py": (["--tiny", "--steps", "2"], "train_step.json"),
    "token_stats.py": (["--tiny"], "token_stats.json"),
    "adaptive_tp.py": (["--tiny", "--one-device"], "adaptive_tp.json"),
    "planner_accuracy.py": (["--tiny"], "planner_accuracy.json"),
    "planner.py": (["--gpus", "16", "--time-limit", "2"], "planner.json"),
}


@pytest.mark.parametrize("script", sorted(CASES))
def test_benchmark_runs_on_cpu(script, tmp_path):
    args, written = CASES[script]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(BENCH / script), *args, "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    assert isinstance(json.loads((tmp_path / written).read_text()), dict)
