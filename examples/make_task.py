"""Write the example tasks shipped with shardflow: ``shardflow/examples/data/arithmetic.jsonl``
(every ``a+b=`` with 0 <= a, b <= 5 and its answer), ``arithmetic_tools.jsonl`` (the two-digit
sums of the calculator example), the character tokenizer files next to them, and the real-model
example's word problems (``word_problems.jsonl`` and the held-out ``word_problems_eval.jsonl``).

    python examples/make_task.py [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shardflow.examples import arithmetic, arithmetic_tools, smollm2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=arithmetic.DATA_DIR,
                        help="directory to write (default: the package's)")
    args = parser.parse_args()
    arithmetic.write_task(args.out)
    arithmetic_tools.write_task(args.out)
    smollm2.write_task(args.out)
    print(f"wrote {len(arithmetic.problems())} + {len(arithmetic_tools.problems())} problems, the tokenizer and "
          f"{smollm2.TRAIN_ROWS} + {smollm2.EVAL_ROWS} word problems to {args.out}")


if __name__ == "__main__":
    main()
