#!/usr/bin/env bash
# Wheels for the TRL comparisons of bench/iteration.py and bench/real_model.py on a machine
# without a package index (Python 3.12, x86-64): TRL and what it needs beyond torch and
# transformers, and gguf (reading the real-model example's GGUF file). Run where pip
# reaches an index; bench/run.py installs whatever lies in .whl/ before its suites run.
#   bash bench/fetch_trl_wheels.sh [DIR]   (default .whl)
set -eu
DIR=${1:-.whl}
mkdir -p "$DIR"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$DIR" \
  trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 gguf==0.19.0
ls "$DIR"
