"""How the engine shares a prompt among its samples, stated once for the engine and its costs.

Several samples of one prompt (GRPO's groups) hold its tokens once:

- decode attention reads a prompt's keys and values once per group of at most ``PROMPT_ROWS``
  of its samples (``engine.generate.decode_attention``);
- inference and training pack a prompt once for all its samples in one row, where that saves at
  least ``MIN_SAVING`` of the padded rows' tokens (``engine.shared_prompts``): packed rows pay for
  the tokens they save with gathers around attention (``models.packed_attention``), so a small
  saving is not worth it.

The planner's cost model charges what these rules make the engine do.
"""

from __future__ import annotations

# Most rows one decode-attention program reads a shared prompt's positions for (the engine gives
# each chunk of this many samples of a prompt its own group): with GQA groups of 2-4 query heads,
# 16-32 query rows.
PROMPT_ROWS = 8

# Least share of the padded rows' tokens that packed rows must save to be used.
MIN_SAVING = 0.05
