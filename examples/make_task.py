"""Write the example task shipped with shardflow: ``shardflow/examples/data/arithmetic.jsonl``
(every ``a+b=`` with 0 <= a, b <= 5 and its answer) and the character tokenizer files next to it.

    python examples/make_task.py [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shardflow.examples.arithmetic import DATA_DIR, problems, write_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="directory to write (default: the package's)")
    args = parser.parse_args()
    write_task(args.out)
    print(f"wrote {len(problems())} problems and the tokenizer to {args.out}")


if __name__ == "__main__":
    main()
