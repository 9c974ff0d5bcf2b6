"""Time of one model call in one layout, from per-operation costs (``OpCosts``) and the workload.

- Generation (pp = 1): each DP replica prefills its prompts (siblings of a prompt share one
  prefill), then decodes; the active batch shrinks as requests finish (expected order statistics
  of the response lengths), and when the KV cache holds fewer slots than requests, the rest wait
  and are admitted as slots free up. A decode step costs every layer's step, the head, and two
  tp all-reduces per layer. With ``share_prompt_kv`` a layer's step is charged at the positions
  its attention reads per row (a prompt once per group of its samples, see ``_read_context``).
- Inference: forward of the replica's tokens in ``k`` micro-batches through ``pp`` stages:
  ``(k + pp - 1)`` times the slowest stage (pipeline fill and drain), each stage paying its layers,
  two tp all-reduces per layer and a point-to-point send of activations. With shared prompts a
  layer runs a prompt's tokens once, its attention over rows that repeat it (``_layer``).
- Training: per optimizer step, the same pipeline with forward + backward (1F1B, bubble
  ``pp - 1``), four tp all-reduces per layer (six with recomputation), each micro-batch's
  gradients added into the float32 buffer, then the data-parallel gradient all-reduce and the
  AdamW step, not overlapped.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from shardflow.config.model import ModelConfig
from shardflow.parallel.layout import Layout
from shardflow.perf.hardware import Cluster
from shardflow.perf.profile import OpCosts
from shardflow.perf.sharing import PROMPT_ROWS
from shardflow.perf.step_time import OpStepTime
from shardflow.plan.memory import Precision, rank_params, stage_layer_count
from shardflow.plan.workload import Workload


def _arrival_order(m: int) -> list[int]:
    """A fixed shuffle of 0..m-1 (golden-ratio stride): requests arrive in no particular length
    order, so when slots are short the queue holds long and short ones alike."""
    step = max(1, round(m * 0.618))
    while math.gcd(step, m) != 1:
        step += 1
    return [(i * step) % m for i in range(m)]


def _merge_runs(runs: list[tuple[float, int, float]], pieces: int = 48) -> list[tuple[float, float, float]]:
    """Merge consecutive runs of decode steps into about ``pieces`` groups, each with the
    step-weighted mean batch and the token-weighted mean context. A step's cost is affine in the
    batch and in batch x context, so this keeps the total nearly exact at a fraction of the work."""
    total = sum(r[0] for r in runs)
    out: list[tuple[float, float, float]] = []
    steps = tokens = kv = 0.0
    for k, batch, context in runs:
        steps, tokens, kv = steps + k, tokens + k * batch, kv + k * batch * context
        if steps >= total / pieces:
            out.append((steps, tokens / steps, kv / tokens))
            steps = tokens = kv = 0.0
    if steps > 0:
        out.append((steps, tokens / steps, kv / tokens))
    return out


@dataclass
class CostModel:
    ops: OpCosts
    workload: Workload
    precision: Precision = field(default_factory=Precision)

    def __post_init__(self) -> None:
        self._cache: dict[tuple, float] = {}
        self._steps: dict[ModelConfig, OpStepTime] = {}

    @property
    def cluster(self) -> Cluster:
        return self.ops.cluster

    # ----- shared pieces ---------------------------------------------------------------------

    def _tp_all_reduce(self, cfg: ModelConfig, layout: Layout, tokens: float) -> float:
        return self.steps(cfg).all_reduce(layout.tp, tokens)  # tp groups never leave a node

    def _stage_send(self, cfg: ModelConfig, layout: Layout, tokens: float) -> float:
        """Activations of one micro-batch to the next stage (the slowest stage boundary)."""
        if layout.pp == 1:
            return 0.0
        nbytes = tokens * cfg.hidden_size * self.precision.activation_bytes
        return max(self.ops.p2p(nbytes, layout.rank_at(s, 0, 0), layout.rank_at(s + 1, 0, 0))
                   for s in range(layout.pp - 1))

    def replica_sequences(self, layout: Layout, steps: int = 1) -> int:
        """Sequences of the fullest DP replica per step: it sets the call's time."""
        return math.ceil(self.workload.sequences / (layout.dp * steps))

    # ----- generation ------------------------------------------------------------------------

    def steps(self, cfg: ModelConfig) -> OpStepTime:
        """Generation's step times of ``cfg`` (the model adaptive TP decides with too)."""
        if cfg not in self._steps:
            self._steps[cfg] = OpStepTime(cfg, self.ops, activation_bytes=self.precision.activation_bytes)
        return self._steps[cfg]

    def decode_step(self, cfg: ModelConfig, layout: Layout, batch: float, context: float) -> float:
        return float(self.steps(cfg).decode(layout.tp, batch, context))

    def prefill(self, cfg: ModelConfig, layout: Layout, requests: float) -> float:
        """The prompts of ``requests`` requests, the samples of a prompt sharing one prefill."""
        w = self.workload
        tokens = requests * w.prompt_tokens / w.samples_per_prompt
        return self.steps(cfg).prefill(layout.tp, tokens, w.prompt_tokens, rows=requests)

    def generate(self, cfg: ModelConfig, layout: Layout, kv_slots: int) -> float:
        """Seconds for every replica to finish its requests with ``kv_slots`` KV-cache slots each."""
        m = self.replica_sequences(layout)
        slots = min(kv_slots, m)
        if slots < 1:
            raise ValueError(f"generation in {layout} has no KV-cache slot")
        key = ("gen", cfg, layout.dp, layout.tp, slots)  # tp groups never leave a node
        if key not in self._cache:
            self._cache[key] = self._generate(cfg, layout, m, slots)
        return self._cache[key]

    def _read_context(self, cfg: ModelConfig, context: float, batch: int, slots: int) -> float:
        """KV positions decode attention reads per row at a mean ``context``. With
        ``share_prompt_kv`` (the engine's decode attention, ``engine.generate.decode_attention``) a prompt's
        samples form groups of at most PROMPT_ROWS rows, and each group reads the prompt once while
        any of its rows is live; rows are taken to leave independently, a fraction batch / slots
        still live. Decode attention is bandwidth-bound, so its cost follows the positions read.
        The engine shares nothing under a sliding window; a model with one anywhere is charged as
        sharing nothing."""
        w = self.workload
        if not (w.share_prompt_kv and w.samples_per_prompt > 1) or any(cfg.sliding_windows):
            return context
        rows = w.samples_per_prompt / math.ceil(w.samples_per_prompt / PROMPT_ROWS)  # rows per group
        live_groups = slots / rows * (1 - (1 - batch / slots) ** rows)
        return context - w.prompt_tokens * (1 - live_groups / batch)

    def _generate(self, cfg: ModelConfig, layout: Layout, m: int, slots: int) -> float:
        lengths = self.workload.response_lengths(m)
        queue = [lengths[i] for i in _arrival_order(m)]
        prompt = self.workload.prompt_tokens
        # Event simulation over runs of decode steps with a constant active batch. A request
        # admitted at step a has context prompt + (s - a) at step s, so the batch's mean context
        # follows from the sum of admission steps of the active requests.
        runs: list[tuple[float, int, float]] = []  # (steps, batch, mean context)
        active: list[tuple[float, float]] = []  # heap of (finish step, admission step)
        admit_sum, step, nxt = 0.0, 0.0, 0
        while nxt < m or active:
            while nxt < m and len(active) < slots:
                # the prefill yields the first token; each later one takes a decode step
                heapq.heappush(active, (step + max(queue[nxt] - 1, 0.0), step))
                admit_sum += step
                nxt += 1
            end, batch = active[0][0], len(active)
            if end > step:
                context = prompt + (step + end) / 2 - admit_sum / batch
                runs.append((end - step, batch, self._read_context(cfg, context, batch, slots)))
            step = end
            while active and active[0][0] <= step:
                admit_sum -= heapq.heappop(active)[1]
        # Prefill: the first wave together, later admissions (when slots ran short) in total.
        seconds = self.prefill(cfg, layout, slots) + (self.prefill(cfg, layout, m - slots) if m > slots else 0.0)
        return seconds + sum(steps * self.decode_step(cfg, layout, batch, context)
                             for steps, batch, context in _merge_runs(runs))

    # ----- inference and training ------------------------------------------------------------

    def _key(self, kind: str, cfg: ModelConfig, layout: Layout, *rest) -> tuple:
        # Costs depend on the ranks only through whether the layout spans nodes (device sets are
        # aligned blocks, so groups of the same shape cross nodes alike).
        return (kind, cfg, layout.pp, layout.dp, layout.tp, self.cluster.one_node(layout.ranks), *rest)

    def _layer(self, cfg: ModelConfig, tp: int, tokens: float, backward: bool = False) -> float:
        """One layer's forward (or backward) over a micro-batch of ``tokens`` model tokens. With
        shared prompts the micro-batch holds a prompt once, but its attention runs over rows that
        hold each sample's prompt again (``models.packed_attention``): charged at those slots."""
        w = self.workload
        if w.model_tokens_of(cfg) < w.mean_tokens:
            slots = tokens * w.mean_tokens / w.model_tokens
            packed = self.ops.packed_layer_backward if backward else self.ops.packed_layer_forward
            return packed(cfg, tp, tokens, slots, w.attention_length)
        plain = self.ops.layer_backward if backward else self.ops.layer_forward
        return plain(cfg, tp, tokens, w.attention_length)

    def inference(self, cfg: ModelConfig, layout: Layout, micro_batches: int) -> float:
        """Forward over the iteration's sequences (log-probabilities or values)."""
        key = self._key("inf", cfg, layout, micro_batches)
        if key not in self._cache:
            w = self.workload
            layers = stage_layer_count(cfg, layout.pp)

            def stage(mb: float) -> float:
                per_layer = self._layer(cfg, layout.tp, mb) + 2 * self._tp_all_reduce(cfg, layout, mb)
                head = self.ops.head_forward(cfg, layout.tp, mb * w.response_share_of(cfg))  # at response tokens
                return layers * per_layer + head + self._stage_send(cfg, layout, mb)

            tokens = self.replica_sequences(layout) * w.model_tokens_of(cfg)
            # pipeline fill and drain: k + pp - 1 slots of the slowest stage
            self._cache[key] = (micro_batches + layout.pp - 1) * stage(tokens / micro_batches)
        return self._cache[key]

    def train(self, cfg: ModelConfig, layout: Layout, micro_batches: int, checkpointing: bool = False, *,
              sharded: bool = False, offloaded: bool = False) -> float:
        """Every optimizer step of the call: pipeline, each micro-batch's gradients added into the
        float32 buffer, gradient reduction, AdamW step. ``sharded``:
        gradients reduce-scattered, each replica updates 1/dp, new weights all-gathered;
        ``offloaded``: the optimizer state crosses the host link both ways (in parallel) per step."""
        key = self._key("train", cfg, layout, micro_batches, checkpointing, sharded, offloaded)
        if key not in self._cache:
            w = self.workload
            layers = stage_layer_count(cfg, layout.pp)

            def stage(mb: float) -> float:
                fwd = self._layer(cfg, layout.tp, mb)
                bwd = self._layer(cfg, layout.tp, mb, backward=True)
                passes = 3 if checkpointing else 2  # all-reduce pairs: forward, backward, recompute
                per_layer = fwd * (2 if checkpointing else 1) + bwd
                per_layer += 2 * passes * self._tp_all_reduce(cfg, layout, mb)
                heads = mb * w.response_share_of(cfg)  # the head runs at response tokens only
                head = self.ops.head_forward(cfg, layout.tp, heads) + self.ops.head_backward(cfg, layout.tp, heads)
                return layers * per_layer + head + 2 * self._stage_send(cfg, layout, mb)

            tokens = self.replica_sequences(layout, w.train_steps) * w.model_tokens_of(cfg)
            pipeline = (micro_batches + layout.pp - 1) * stage(tokens / micro_batches)  # 1F1B
            params = rank_params(cfg, layout.pp, layout.tp)
            accumulate = micro_batches * self.ops.grad_accumulate(cfg, layout.tp, params)
            dp_group, p = layout.dp_group(layout.ranks[0]), self.precision
            if sharded:  # a reduce-scatter and an all-gather each move half of an all-reduce's bytes
                grads = (self.ops.all_reduce(params * p.grad_bytes, dp_group)
                         + self.ops.all_reduce(params * p.param_bytes, dp_group)) / 2
                params /= layout.dp
            else:
                grads = self.ops.all_reduce(params * p.grad_bytes, dp_group)
            optimizer = self.ops.optimizer(cfg, layout.tp, params)
            if offloaded:  # streamed: the step runs at the slower of the device and the host link
                optimizer = max(optimizer, params * p.optimizer_bytes / self.ops.cluster.host_bandwidth)
            self._cache[key] = w.train_steps * (pipeline + accumulate + grads + optimizer)
        return self._cache[key]
