"""The generation engine of one data-parallel replica: admission, prefill, decode, retirement.

Every tp rank of a replica runs the same loop on the same requests and takes the same decisions,
because they depend only on data every rank holds identically (the requests and the sampled
tokens, which ``sampling.sample`` makes identical across tp). ``submit`` queues requests; each
``step`` does:

1. admit waiting requests into free KV slots, first come first served; the samples of one prompt
   are admitted together (at most ``num_slots`` at a time) and share one prefill (and, in a paged
   cache, the prompt's whole blocks);
2. prefill the admitted prompts in chunks of at most ``max_prefill_tokens`` padded tokens, writing
   each prompt's KV into the slots of all its samples, and sample every request's first token;
3. launch one decode step over every active request (graph-captured on GPU), then read back the
   tokens of the step launched before it: the host does its bookkeeping while the device decodes,
   and a batch whose rows do not change goes from step to step without host work in between
   (the step writes its own next inputs, see ``cuda_graphs``);
4. retire the requests that those tokens finished, freeing their slots, so the active batch
   shrinks.

In a paged cache (``kv_block_size``) a request holds blocks for the positions it has reached, plus
the one its next step writes; before each launch the active rows get the blocks they are about to
need. When too few are free, requests are preempted, the latest admitted first (after parked
episodes, which are idle): their KV is dropped and they wait at the head of the queue, to be
prefilled again from ``prompt + output`` and go on with the same tokens (sampling is seeded by
position).

Reading tokens one step late costs one wasted row for a request that stops on an EOS or stop
token (it was already in the next step; that row's token is dropped). Length limits are known in
advance, so a request that ends by length runs no extra step. ``flush`` reads back the step in
flight; admissions, ``evict`` and ``detach`` do it first. ``generate`` steps until every request
is done. ``evict`` takes unfinished requests out with
their state; a request that arrives with generated tokens already (moved from another engine) is
prefilled with ``prompt + output[:-1]`` (recomputing its KV) and continues from its last token.
``detach`` and ``adopt`` move requests whose KV stays where it is: between engines that decode
into views of the same cache memory (adaptive tensor parallelism).

Multi-turn episodes (``Request.keep_kv``): a request whose turn ends keeps its slot ("parked");
after ``Request.continue_with`` appends an observation, ``submit`` prefills only the tokens after
``cached_len`` onto the slot's KV (attending over the cached history) and decoding goes on: the
history is never prefilled again. ``close`` frees a parked request's slot when its episode ends.
``evict`` and ``detach`` drop parked requests' KV (a later turn then recomputes it).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from shardflow.config.experiment import BLAS_LIBRARIES, COMPILE_MODES
from shardflow.engine.compile_fallback import compiled_or_eager
from shardflow.engine.generate.cuda_graphs import DecodeRunner
from shardflow.engine.generate.decode_attention import ATTENTION
from shardflow.engine.generate.decode_weights import decode_weights_layout, drop_decode_weights, make_decode_weights
from shardflow.engine.generate.kv_cache import KVCache, bytes_per_slot, check_block_size
from shardflow.engine.generate.requests import Request
from shardflow.engine.generate.sampling import SamplingTensors, batch_mode, pick, sample
from shardflow.engine.generate.steps import (
    decode_end,
    decode_layer,
    decode_logits,
    decode_start,
    extend_cache,
    prefill_logits,
    step_compile_options,
)
from shardflow.models.transformer import Transformer
from shardflow.parallel.device_memory import free_bytes
from shardflow.perf.sharing import PROMPT_ROWS

# Prompt-group numbers, unique within the process (requests move between its engines).
_PROMPT_GROUPS = itertools.count()


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    max_seq_len: int | None = None  # prompt + completion tokens; None: the model's max_position_embeddings
    max_batch_size: int = 256  # most requests decoded at once (KV slots)
    # this rank's KV budget; None: max_batch_size slots (CPU), 90% of free memory (GPU)
    kv_cache_bytes: int | None = None
    max_prefill_tokens: int = 16384  # padded tokens in one prefill forward
    attention: str = "auto"  # decode attention: "torch", "triton", or "auto" (triton on CUDA)
    cuda_graphs: bool | None = None  # capture decode steps as CUDA graphs; None: on CUDA
    compile: bool = False  # torch.compile the decode step's layers (fuses elementwise ops; tp = 1 only)
    compile_mode: str = "default"  # torch.compile mode of the decode layers (one that leaves graphs to the engine)
    combo_kernels: bool = True  # the compiled step with inductor's combo kernels (``steps.step_compile_options``)
    # The BLAS library of the decode step's products on CUDA ("cublas" or "cublaslt"); None: torch's
    # default. Which one is faster depends on the shape and batch (see BENCHMARKS.md); fixed per
    # run, not timed at run time, so that a seed gives the same tokens in every run.
    blas_library: str | None = None
    # Decode products read their weights stored transposed ([in, out]): other cuBLAS kernels
    # (BENCHMARKS.md), for a copy of o, down and the LM head (memory the KV cache then lacks). On
    # CPU only this option makes decode copies at all (to test the path).
    transposed_weights: bool = False
    # Decode attention reads the prompt of a prefill's samples once for all of them (GRPO groups):
    # fewer KV bytes by the prompt's share of each context (Triton attention only; see
    # ``decode_attention``).
    share_prompt_kv: bool = True
    # Tokens per KV cache block: the cache holds blocks as requests reach them instead of max_seq_len
    # per request (long-tailed lengths fit more requests in the same memory); None: one contiguous
    # block of max_seq_len per slot.
    kv_block_size: int | None = None

    def __post_init__(self) -> None:
        if self.attention not in ("auto", *ATTENTION):
            raise ValueError(f"attention must be one of auto, {', '.join(ATTENTION)}; got {self.attention!r}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be at least 2, got {self.max_seq_len}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be positive, got {self.max_batch_size}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {', '.join(COMPILE_MODES)}; got {self.compile_mode!r}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be positive, got {self.max_prefill_tokens}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        check_block_size(self.kv_block_size)
        if self.blas_library not in (None, *BLAS_LIBRARIES):
            raise ValueError(f"blas_library must be one of {', '.join(BLAS_LIBRARIES)} or None; "
                             f"got {self.blas_library!r}")


@dataclass
class _Launched:
    """A decode step in flight: its rows, and where its tokens arrive on the host."""
    rows: list[Request]
    host: torch.Tensor  # [2, rows]: tokens, log-probabilities (copied asynchronously on CUDA)
    ready: torch.cuda.Event | None  # recorded after the copy (CUDA)
    start: float  # when it was launched


@dataclass
class GenerationStats:
    decode_steps: list[tuple[int, float]] = field(default_factory=list)  # (active batch, seconds) per step
    prefill_seconds: float = 0.0
    prefill_tokens: int = 0  # real (unpadded) tokens prefilled
    generated_tokens: int = 0
    preemptions: int = 0  # requests whose KV was dropped for want of cache blocks (recomputed later)


class GenerationEngine:
    def __init__(self, model: Transformer, config: EngineConfig = EngineConfig(), *,
                 eos_token_ids: Sequence[int] = (), cache: KVCache | None = None):
        """``cache``: decode into this existing cache (see ``use_cache``) instead of allocating one."""
        cfg, shard = model.cfg, model.shard
        if not (shard.first_stage and shard.last_stage):
            raise ValueError(f"generation with pipeline parallelism is not supported (layout {shard.layout}); "
                             "use pp=1")
        if cfg.value_head:
            raise ValueError("a value model has no LM head and cannot generate")
        param = next(model.parameters())
        self.model, self.config = model, config
        self.device, self.dtype = param.device, param.dtype
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.attention_name = config.attention if config.attention != "auto" else (
            "triton" if self.device.type == "cuda" else "torch")
        self.attention = ATTENTION[self.attention_name]
        self.use_graphs = self.device.type == "cuda" if config.cuda_graphs is None else config.cuda_graphs
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {self.device}")
        if config.compile and shard.tp_size > 1:
            raise ValueError("compile is implemented for tp=1 only; run tp > 1 without it")
        if config.blas_library is not None and self.device.type != "cuda":
            raise ValueError(f"blas_library {config.blas_library!r} needs a CUDA device; the model is on {self.device}")
        # Compiled layer by layer: one layer's code serves all of them (tracing and compiling the
        # whole unrolled stack took most of a first iteration); the step's work before and after
        # its layers (embedding, rotary tables, block lookups; the final norm and head; the
        # sampler's pick among its candidates) compiles apart, each into a few kernels instead of
        # a dozen small ones.
        def compiled(fn, what):
            if not config.compile:  # uncompiled processes never load the compiler (seconds)
                return fn
            options, fallback = step_compile_options(config.compile_mode, config.combo_kernels)
            return compiled_or_eager(fn, what, fallback=fallback, **options)

        self._layer_fn = compiled(decode_layer, "the decode layer")
        self._start_fn = compiled(decode_start, "the decode step's start")
        self._end_fn = compiled(decode_end, "the decode step's end")
        self._pick_fn = compiled(pick, "the sampler's pick")
        self._step_fn = with_blas_library(self._step, config.blas_library)
        self.stats = GenerationStats()
        self.waiting: deque[list[Request]] = deque()  # prefill units waiting for free slots
        self.active: list[Request] = []  # requests holding a slot, in admission order
        self.parked: dict[int, Request] = {}  # episodes between turns, holding their slots (by request id)
        self._launched: _Launched | None = None  # the decode step whose tokens are not read yet
        self._last_read = 0.0  # when the last step's tokens were read (perf_counter)
        self.cache: KVCache | None = None
        if cache is None:
            self.reset_cache()
        else:
            self.use_cache(cache)

    # ----- memory ------------------------------------------------------------------------------

    def reset_cache(self, *, max_seq_len: int | None = None, kv_cache_bytes: int | None = None) -> None:
        """(Re)allocate the KV cache while no request holds a slot; drops captured graphs."""
        if self.active or self._launched or self.parked:
            raise RuntimeError("cannot reallocate the KV cache while requests hold slots; evict them first")
        cfg, shard, config = self.model.cfg, self.model.shard, self.config
        self.max_seq_len = max_seq_len or config.max_seq_len or cfg.max_position_embeddings
        if self.max_seq_len > cfg.max_position_embeddings:
            raise ValueError(f"max_seq_len={self.max_seq_len} exceeds the model's max_position_embeddings="
                             f"{cfg.max_position_embeddings}")
        max_len = self.max_seq_len - 1  # the last token of a full sequence is never fed back
        self.release_cache()
        if self._decode_copies:  # fresh copies of the current weights, before sizing the cache
            make_decode_weights(self.model, config.transposed_weights)
        budget = kv_cache_bytes or config.kv_cache_bytes or self._default_budget(max_len)
        self.cache = KVCache.for_model(cfg, shard, budget_bytes=budget, max_len=max_len,
                                       max_slots=config.max_batch_size, dtype=self.dtype, device=self.device,
                                       block_size=config.kv_block_size)
        self._make_decode()

    def use_cache(self, cache: KVCache) -> None:
        """Decode into ``cache`` (e.g. a regrouped view of another engine's cache) while no request
        holds a slot; every slot of it must be free. Drops captured graphs."""
        if self.active or self.waiting or self._launched or self.parked:
            raise RuntimeError("cannot switch the KV cache while requests are queued or hold slots")
        layers, shard = tuple(self.model.model.layers.keys()), self.model.shard
        first = next(iter(cache.k.values()))
        if (tuple(str(i) for i in cache.k) != layers or first.shape[1] != shard.num_kv_heads
                or first.shape[3] != self.model.cfg.head_dim or first.dtype != self.dtype
                or first.device != self.device):
            raise ValueError(f"a KV cache of layers {list(cache.k)}, shape {list(first.shape)}, {first.dtype} on "
                             f"{first.device} does not fit this model shard ({shard.num_kv_heads} KV heads of "
                             f"{self.model.cfg.head_dim}, {self.dtype} on {self.device})")
        self.cache, self.max_seq_len = cache, cache.max_len + 1
        if self._decode_copies and decode_weights_layout(self.model) != self._decode_layout:  # as reset_cache
            make_decode_weights(self.model, self.config.transposed_weights)
        self._make_decode()

    def _make_decode(self) -> None:
        if self.config.compile:  # one compiled graph serves every cache size
            for t in (*self.cache.k.values(), *self.cache.v.values()):
                torch._dynamo.mark_dynamic(t, 0)
                torch._dynamo.mark_dynamic(t, 2)
        self.decode = DecodeRunner(self._step_fn, max_batch=self.cache.num_slots,
                                   scratch_slot=self.cache.scratch_slot, device=self.device, graphs=self.use_graphs)
        # Two host buffers for read-back: one step's tokens arrive while the other's are read.
        pinned = self.device.type == "cuda"
        self._host = [torch.empty(2, self.cache.num_slots, dtype=torch.float64, pin_memory=pinned)
                      for _ in range(2)]

    def release_cache(self) -> None:
        """Free the KV cache, the graphs that read it and the fused weight copies (``reset_cache``
        makes new ones)."""
        if self._launched is not None:
            raise RuntimeError("cannot release the KV cache with a decode step in flight; flush or evict first")
        if self.parked:
            raise RuntimeError(f"cannot release the KV cache while {len(self.parked)} episodes hold slots "
                               "between turns; close them first")
        self.cache = self.decode = None
        drop_decode_weights(self.model)
        # The memory stays with torch's allocator (no empty_cache): the calls that follow in this
        # process reuse it without new device allocations, and _default_budget counts it as free.

    @property
    def _decode_copies(self) -> bool:
        """Whether decoding reads copies of the weights (``decode_weights.make_decode_weights``):
        always on GPUs (q/k/v and gate/up concatenated), on CPU with ``transposed_weights``."""
        return self.device.type == "cuda" or self.config.transposed_weights

    @property
    def _decode_layout(self) -> str:
        return "transposed" if self.config.transposed_weights else "concatenated"

    def _default_budget(self, max_len: int) -> int:
        cfg, shard, config = self.model.cfg, self.model.shard, self.config
        if self.device.type != "cuda":
            return (config.max_batch_size + 1) * bytes_per_slot(shard, cfg, max_len, self.dtype)
        free = free_bytes(self.device)
        item = torch.empty((), dtype=self.dtype).element_size()
        # Room for prefill activations and for sampling over [batch, vocabulary] in float32.
        prefill = config.max_prefill_tokens * (6 * cfg.hidden_size + 3 * shard.intermediate_size) * item
        sampling = 8 * config.max_batch_size * cfg.vocab_size * 4
        budget = torch.tensor([max(1, int(0.9 * free) - prefill - sampling - (1 << 30))], device=self.device)
        if self.model.tp_group is not None:  # the ranks of a replica take one decision: one cache size
            dist.all_reduce(budget, op=dist.ReduceOp.MIN, group=self.model.tp_group)
        return int(budget)

    # ----- one decode step (what a CUDA graph captures) -------------------------------------------

    def _step(self, ints: torch.Tensor, floats: torch.Tensor,
              key: tuple[str, bool]) -> tuple[torch.Tensor, torch.Tensor]:
        """ints [7,B] (tokens, positions, slots, top_k, seeds, prompt groups, shared prompt lengths),
        floats [2,B] (temperature, top_p); ``key``: see ``_graph_key``."""
        mode, shares = key
        tokens, positions, slots, top_k, seeds, groups, prompt = ints.unbind(0)
        temperature, top_p = floats.unbind(0)
        prompts = (groups, prompt) if shares else None
        # On the CPU a host read waits for no device, and no graph or compiled layer needs fixed
        # shapes: eager CPU steps hand attention only the cache the rows reach.
        span = int(positions.max()) + 1 if self.device.type == "cpu" and not self.config.compile else None
        logits = decode_logits(self.model, self.cache, self.attention, tokens, positions, slots, prompts,
                               layer_fn=self._layer_fn, span=span, start_fn=self._start_fn, end_fn=self._end_fn)
        st = SamplingTensors(temperature=temperature, top_k=top_k, top_p=top_p, seed=seeds, position=positions + 1)
        return sample(logits, st, vocab_start=self.model.shard.vocab_start, vocab_size=self.model.cfg.vocab_size,
                      group=self.model.tp_group, mode=mode, pick_fn=self._pick_fn)

    # ----- the loop ------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, requests: Sequence[Request],
                 on_finish: Callable[[Request], None] | None = None) -> Sequence[Request]:
        """Run ``requests`` to completion (in place); ``on_finish`` is called as each one ends."""
        self.submit(requests)
        while self.busy:
            self.step(on_finish)
        return requests

    def submit(self, requests: Sequence[Request]) -> None:
        """Queue requests (fresh, carrying generated tokens from elsewhere, or episodes parked here
        whose next turn begins) for admission."""
        for r in requests:
            resumed = r.slot is not None and self.parked.get(r.request_id) is r
            if r.done or (r.slot is not None and not resumed):
                raise ValueError(f"request {r.request_id} is already finished or admitted elsewhere")
            if not r.prompt_ids:
                raise ValueError(f"request {r.request_id} has an empty prompt")
            if r.num_tokens >= self.max_seq_len:
                raise ValueError(f"request {r.request_id}: {r.num_tokens} tokens leave no room to generate "
                                 f"under max_seq_len={self.max_seq_len}")
        resumed = [r for r in requests if self.parked.pop(r.request_id, None) is not None]
        # resumed episodes need no new slot: ahead of the queue, so that fresh requests waiting for
        # the slots they hold do not block them
        self.waiting.extendleft([[r] for r in reversed(resumed)])
        self.waiting.extend(self._prefill_units([r for r in requests if r not in resumed]))

    def close(self, requests: Sequence[Request]) -> None:
        """Free the slots of parked episodes that are over."""
        for r in requests:
            if self.parked.pop(r.request_id, None) is not r:
                raise ValueError(f"request {r.request_id} is not parked in this engine")
            self.cache.release(r.slot)
            r.drop_kv()

    @property
    def in_flight(self) -> int:
        """Rows of the decode step launched but not yet read back (0 if none)."""
        return len(self._launched.rows) if self._launched else 0

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.active or self._launched)

    @property
    def stalled(self) -> bool:
        """Nothing can run until a parked episode resumes or closes: no active request, and the
        next waiting one needs slots that parked episodes hold."""
        return (not self.active and not self._launched and bool(self.waiting)
                and _slots_needed(self.waiting[0]) > self.cache.num_free)

    def _admissible(self, unit: list[Request]) -> bool:
        return _slots_needed(unit) <= self.cache.num_free and self._blocks_needed(unit) <= self.cache.num_free_blocks

    def _blocks_needed(self, unit: list[Request]) -> int:
        """Blocks a unit takes to be prefilled and decode its next step (0 in a contiguous cache):
        a fresh unit's samples share its prompt's whole blocks."""
        cache, first = self.cache, unit[0]
        if not cache.paged:
            return 0
        if first.slot is not None:  # a resumed episode: its new tokens onto the blocks it holds
            return cache.blocks_missing(first.slot, first.num_tokens + 1)
        prompt = len(_prefill_ids(first))
        shared = prompt // cache.block_size if len(unit) > 1 else 0
        return shared + len(unit) * (cache.blocks_for(min(prompt + 2, cache.max_len)) - shared)

    @torch.no_grad()
    def step(self, on_finish: Callable[[Request], None] | None = None) -> None:
        """One iteration: admit and prefill what fits, then one decode step over the active batch."""
        self.prefill_waiting(on_finish)
        if self.active or self._launched:
            self._decode_step(on_finish)

    def flush(self, on_finish: Callable[[Request], None] | None = None) -> None:
        """Read back the decode step in flight, if any, and retire the requests it finished."""
        launched, self._launched = self._launched, None
        if launched is not None:
            self._read(launched)
            self._retire(on_finish)

    @torch.no_grad()
    def prefill_waiting(self, on_finish: Callable[[Request], None] | None = None) -> None:
        """Admit waiting requests into free slots and prefill them (the first half of ``step``)."""
        if self.waiting and not (self.active or self._launched):
            self._fit_head()
        if self.waiting and self._admissible(self.waiting[0]):
            self.flush(on_finish)  # the next decode step takes the admitted rows from the host
        admitted = []
        while self.waiting and self._admissible(self.waiting[0]):
            unit = self.waiting.popleft()
            fresh = [r for r in unit if r.slot is None]  # a resumed episode keeps its slot
            for r, slot in zip(fresh, self.cache.allocate(len(fresh))):
                r.slot = slot
            self._give_blocks(unit)
            admitted.append(unit)
        # nothing admitted and nothing decoding: the head waits for slots no one will free (only a
        # parked episode's close or resume can: the caller checks ``stalled`` first)
        assert admitted or self.active or self._launched or not self.waiting, "a prefill unit larger than the cache"
        if admitted:
            self._prefill(admitted)
            self.active += [r for unit in admitted for r in unit]
            self._retire(on_finish)

    def evict(self, on_finish: Callable[[Request], None] | None = None) -> list[Request]:
        """Take out every unfinished request, active ones first, and free their slots. Their tokens,
        log-probabilities and seeds stay with them; their KV does not (``cached_len`` drops to 0),
        so submitting them to any engine recomputes it and continues where they stopped. The step
        in flight is read first (``on_finish`` sees the requests it finishes)."""
        self.flush(on_finish)
        waiting = [r for unit in self.waiting for r in unit]
        for r in [*self.active, *self.parked.values(), *waiting]:
            if r.slot is not None:  # waiting: a resumed episode keeps its slot until admitted
                self.cache.release(r.slot)
                r.drop_kv()
        requests = self.active + waiting
        self.active, self.waiting, self.parked = [], deque(), {}
        return requests

    def detach(self, on_finish: Callable[[Request], None] | None = None) -> tuple[list[Request], list[Request]]:
        """Take out every unfinished request, keeping its KV where it is: returns (active requests
        in batch order with their slots and ``cached_len``, waiting requests in queue order). The
        cache forgets them (every slot free), so that an engine over a view of the same memory can
        ``adopt`` them. The step in flight is read first (``on_finish`` sees what it finishes)."""
        self.flush(on_finish)
        active, waiting = self.active, [r for unit in self.waiting for r in unit]
        for r in [*self.parked.values(), *waiting]:  # parked and resumed episodes: their KV is not carried
            r.drop_kv()
        self.active, self.waiting, self.parked = [], deque(), {}
        self.cache.release_all()
        return active, waiting

    def adopt(self, requests: Sequence[Request], blocks: Mapping[int, list[int]] | None = None) -> None:
        """Requests whose KV is already in this engine's cache (``slot`` and ``cached_len`` set)
        join the end of the active batch, in order; in a paged cache ``blocks`` names each one's
        blocks (by request id)."""
        for r in requests:
            if r.done or r.slot is None or not 0 < r.cached_len <= r.num_tokens - 1:
                raise ValueError(f"request {r.request_id} cannot be adopted: done={r.done}, slot={r.slot}, "
                                 f"cached_len={r.cached_len} of {r.num_tokens} tokens")
        if self._launched is not None:
            raise RuntimeError("cannot adopt requests with a decode step in flight; flush first")
        if self.cache.paged and (blocks is None or any(r.request_id not in blocks for r in requests)):
            raise ValueError("requests adopted into a paged KV cache need their blocks")
        self.cache.reserve([r.slot for r in requests])
        for r in requests:
            if self.cache.paged:
                self.cache.assign(r.slot, blocks[r.request_id])
        for r in requests:  # their prompt groups were numbered by other engines, maybe other processes
            r.prompt_group, r.shared_prompt = -1, 0
        self.active += list(requests)

    # ----- blocks of a paged cache ---------------------------------------------------------------

    def _fit_head(self) -> None:
        """Nothing decodes, so nothing frees blocks: make the head of the queue fit a paged cache by
        dropping parked episodes' KV, then by splitting the head unit (a prompt's samples) to the
        samples that fit; one sample always fits (the cache holds one max_seq_len sequence)."""
        if not self.cache.paged:
            return
        unit = self.waiting[0]
        while self._blocks_needed(unit) > self.cache.num_free_blocks and self._preempt_one(active=False):
            pass
        keep = len(unit)
        while keep > 1 and self._blocks_needed(unit[:keep]) > self.cache.num_free_blocks:
            keep -= 1
        if keep < len(unit):
            self.waiting[0] = unit[:keep]
            self.waiting.insert(1, unit[keep:])

    def _give_blocks(self, unit: list[Request]) -> None:
        """An admitted unit's blocks for its prefill: the first sample's, whose whole blocks the
        other samples share, then each one's own rest."""
        cache, first = self.cache, unit[0]
        if not cache.paged:
            return
        if first.cached_len:  # a resumed episode
            given = cache.ensure([first.slot], [first.num_tokens - 1])
        else:
            prompt = len(_prefill_ids(first))
            given = cache.ensure([first.slot], [prompt])
            cache.share(first.slot, [r.slot for r in unit[1:]], prompt)
            given = given and cache.ensure([r.slot for r in unit[1:]], [prompt] * (len(unit) - 1))
        if not given:  # _admissible counted them
            raise RuntimeError(f"the KV cache ran out of blocks admitting request {first.request_id}")

    def _grow(self, rows: list[Request]) -> bool:
        """Blocks for the position each row's next step writes (and, with a step in flight, the one
        after): False if too few are free."""
        return self.cache.ensure([r.slot for r in rows], [r.cached_len + 2 for r in rows])

    def _preempt_one(self, *, active: bool = True) -> bool:
        """Drop the KV of the oldest parked episode or else (with ``active``) of the latest admitted
        active request, which goes back to the head of the queue; False if there is none. No step
        may be in flight."""
        assert self._launched is None
        if self.parked:
            r = self.parked.pop(next(iter(self.parked)))  # its next turn, when submitted, recomputes its history
        elif active and self.active:
            r = self.active.pop()
            self.waiting.appendleft([r])
        else:
            return False
        self.cache.release(r.slot)
        r.drop_kv()
        self.stats.preemptions += 1
        return True

    def warm_graphs(self, batch: int, modes: Sequence[str], *, shared: bool = False) -> int:
        """Capture the decode graphs of every batch bucket up to ``batch``'s for the sampling
        ``modes`` now (otherwise each is captured at its first use), for rows that read shared
        prompts or (default) for rows that do not; returns how many were captured. Collective over
        the tp group, like a decode step. A no-op without CUDA graphs."""
        if not self.use_graphs:
            return 0
        buckets = [n for n in self.decode.buckets if n <= self.decode.bucket(batch)]
        shares = shared and self.config.share_prompt_kv
        return sum(self.decode.capture(n, (mode, shares)) for n in buckets for mode in modes)

    def step_batches(self, batch: int, *, varying: bool = True) -> list[int]:
        """The batch sizes whose decode steps compile in a generate call whose first step holds
        ``batch`` rows: the first step's, and with ``varying`` (rows finish at different steps) those
        that dynamo compiles as the batch shrinks (its size dynamic; then one row, which it
        specialises, unless one row is padded to a bucket of two). None without ``compile``."""
        if not self.config.compile:
            return []
        first = self.decode.bucket(min(batch, self.decode.buckets[-1]))
        sizes = [first]
        if varying and first > 2:
            sizes.append(self.decode.bucket(first // 2))
        if varying and first > 1 and self.decode.bucket(1) == 1:
            sizes.append(1)
        return sizes

    def compile_step(self, batch: int, modes: Sequence[str], *, shared: bool = False) -> None:
        """Compile the decode step of ``batch`` rows (one of ``step_batches``) for the sampling
        ``modes``, rows reading shared prompts where ``shared``, as a generate call would; nothing
        is captured."""
        shares = shared and self.config.share_prompt_kv
        with torch.no_grad():  # as ``generate``: the grad mode is part of what compiles
            for mode in modes:
                self.decode.warm(batch, (mode, shares))

    def _graph_key(self, rows: list[Request]) -> tuple[str, bool]:
        """What a decode step is specialised (and its graph captured) for: the rows' sampling mode,
        and whether any row reads a shared prompt; a step where none does skips the prompt kernel."""
        return _mode(rows), self.config.share_prompt_kv and any(r.prompt_group >= 0 for r in rows)

    def _prefill_units(self, requests: Sequence[Request]) -> list[list[Request]]:
        """Requests that share one prefill: fresh samples of one prompt (at most ``num_slots``);
        a request with generated tokens is its own unit."""
        units: list[list[Request]] = []
        by_group: dict[int, list[Request]] = {}
        for r in requests:
            unit = by_group.get(r.group) if not r.output_ids else None
            if unit is None or len(unit) == self.cache.num_slots or unit[0].prompt_ids != r.prompt_ids:
                unit = []
                units.append(unit)
                if not r.output_ids:
                    by_group[r.group] = unit
            unit.append(r)
        return units

    def _prefill(self, units: list[list[Request]]) -> None:
        start = time.perf_counter()
        fresh = [u for u in units if u[0].cached_len == 0]
        resumed = [u[0] for u in units if u[0].cached_len > 0]
        chunk: list[list[Request]] = []
        for unit in fresh:
            width = max(len(_prefill_ids(u[0])) for u in chunk + [unit])
            if chunk and width * (len(chunk) + 1) > self.config.max_prefill_tokens:
                self._prefill_chunk(chunk)
                chunk = []
            chunk.append(unit)
        if chunk:
            self._prefill_chunk(chunk)
        rows: list[Request] = []
        for r in resumed:  # a chunk's cost: its rows x the longest history they attend over
            span = max(x.num_tokens for x in rows + [r])
            if rows and span * (len(rows) + 1) > max(self.config.max_prefill_tokens, span):
                self._extend_chunk(rows)
                rows = []
            rows.append(r)
        if rows:
            self._extend_chunk(rows)
        self.stats.prefill_seconds += time.perf_counter() - start

    def _extend_chunk(self, requests: list[Request]) -> None:
        """Prefill each request's tokens after ``cached_len`` onto its slot's KV (a resumed episode)."""
        seqs = [_prefill_ids(r) for r in requests]
        width = max(len(x) for x in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, x in enumerate(seqs):
            ids[i, : len(x)] = torch.tensor(x)
        dev = self.device
        starts = torch.tensor([r.cached_len for r in requests], device=dev)
        lengths = torch.tensor([len(x) for x in seqs], device=dev)
        slots = torch.tensor([r.slot for r in requests], device=dev)
        extend_cache(self.model, self.cache, ids.to(dev), starts, lengths, slots)
        self.stats.prefill_tokens += int(lengths.sum())
        for r, x in zip(requests, seqs):
            r.cached_len += len(x)

    def _prefill_chunk(self, units: list[list[Request]]) -> None:
        """Prefill fresh (or recomputed) requests from their first token."""
        seqs = [_prefill_ids(u[0]) for u in units]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        lengths = torch.tensor([len(s) for s in seqs])
        logits = prefill_logits(self.model, self.cache, ids.to(self.device), lengths.to(self.device),
                                self._prefill_writes(units))  # [G, V_local]
        self.stats.prefill_tokens += int(lengths.sum())
        fresh, rows = [], []
        for i, (unit, seq) in enumerate(zip(units, seqs)):
            # prompt groups of at most PROMPT_ROWS adjacent rows, as the attention kernel asks
            groups = [next(_PROMPT_GROUPS) for _ in range(-(-len(unit) // PROMPT_ROWS))] if len(unit) > 1 else []
            for j, r in enumerate(unit):
                r.cached_len = len(seq)
                if groups:
                    r.prompt_group, r.shared_prompt = groups[j // PROMPT_ROWS], len(seq)
                if not r.output_ids:
                    fresh.append(r)
                    rows.append(i)
        if fresh:
            ints, floats = _step_inputs(fresh)
            st = SamplingTensors(temperature=floats[0], top_k=ints[3], top_p=floats[1], seed=ints[4],
                                 position=torch.tensor([r.num_tokens for r in fresh]))
            st = SamplingTensors(**{k: v.to(self.device) for k, v in vars(st).items()})
            tokens, logprobs = sample(logits[torch.tensor(rows, device=self.device)], st,
                                      vocab_start=self.model.shard.vocab_start,
                                      vocab_size=self.model.cfg.vocab_size, group=self.model.tp_group,
                                      mode=_mode(fresh))
            self._record_device(fresh, tokens, logprobs)

    def _prefill_writes(self, units: list[list[Request]]) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
        """Every sample of a unit gets the unit's keys and values: one write per layer for the units
        of each sample count (usually one count), so that no row's write is padded."""
        writes = []
        for n in sorted({len(u) for u in units}):
            rows = [i for i, u in enumerate(units) if len(u) == n]
            slots = torch.tensor([[r.slot for r in units[i]] for i in rows], device=self.device)
            writes.append((None if len(rows) == len(units) else torch.tensor(rows, device=self.device), slots))
        return writes

    def _decode_step(self, on_finish: Callable[[Request], None] | None) -> None:
        """Launch the next decode step, then read back the one before it."""
        prev = self._launched
        if prev is None:  # every row's state is on the host
            rows = list(self.active)
            self._load(rows)
        else:  # the rows of the step in flight that go on after it; its tokens are on the device
            assert len(self.active) <= len(prev.rows), "rows joined without a flush"
            keep = [i for i, r in enumerate(prev.rows)
                    if not r.done and not r.ends_by_length(self.max_seq_len, pending=1)]
            rows = [prev.rows[i] for i in keep]
            if len(rows) < len(prev.rows):
                self.decode.keep(keep)
        if rows and not self._grow(rows):  # too few blocks: read the step in flight, then preempt
            self.flush(on_finish)
            while self.active and not self._grow(self.active):
                self._preempt_one()
            prev, rows = None, list(self.active)
            if rows:
                self._load(rows)
        self._launched = self._launch(rows) if rows else None
        if prev is not None:
            self._read(prev)
            self._retire(on_finish)

    def _load(self, rows: list[Request]) -> None:
        """The rows' inputs from the host: each one's last token at its position."""
        ints, floats = _step_inputs(rows)
        ints[0] = torch.tensor([r.output_ids[-1] for r in rows])
        self.decode.load(ints, floats)

    def _launch(self, rows: list[Request]) -> _Launched:
        start = time.perf_counter()
        tokens, logprobs = self.decode.run(self._graph_key(rows))
        self._host.reverse()
        host = self._host[0][:, :len(rows)]
        host.copy_(torch.stack([tokens.double(), logprobs.double()]), non_blocking=True)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return _Launched(rows, host, ready, start)

    def _read(self, launched: _Launched) -> None:
        """Wait for a launched step's tokens and record them; rows whose request ended on an
        earlier token are dropped."""
        if launched.ready is not None:
            launched.ready.synchronize()
        live = [(r, i) for i, r in enumerate(launched.rows) if not r.done]
        for r, _ in live:
            r.cached_len += 1
        self._record([r for r, _ in live], launched.host[:, [i for _, i in live]])
        now = time.perf_counter()
        self.stats.decode_steps.append((len(launched.rows), now - max(launched.start, self._last_read)))
        self._last_read = now

    def _record_device(self, requests: list[Request], tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Record tokens still on the device (waits for them)."""
        self._record(requests, torch.stack([tokens.double(), logprobs.double()]).cpu())  # one copy

    def _record(self, requests: list[Request], host: torch.Tensor) -> None:
        """host [2, len(requests)]: tokens, log-probabilities."""
        for r, token, logprob in zip(requests, host[0].long().tolist(), host[1].tolist()):
            r.append(token, logprob, stop_ids=self._stop_ids(r), max_seq_len=self.max_seq_len)
        self.stats.generated_tokens += len(requests)

    def _stop_ids(self, r: Request) -> frozenset[int]:
        stop = frozenset(r.params.stop_token_ids)
        return stop if r.params.ignore_eos else stop | self.eos_token_ids

    def _retire(self, on_finish: Callable[[Request], None] | None) -> None:
        """Free the slots of finished requests at once: the active batch shrinks."""
        still = []
        for r in self.active:
            if not r.done:
                still.append(r)
                continue
            if r.keep_kv:  # an episode's turn: the slot waits for its next one, or for ``close``
                self.parked[r.request_id] = r
            else:
                self.cache.release(r.slot)
                r.drop_kv()
            if on_finish is not None:
                on_finish(r)
        self.active = still


def _prefill_ids(r: Request) -> list[int]:
    """The tokens whose KV a request's slot needs before its next decode step: all but the last
    (which that step feeds), from ``cached_len`` on."""
    tokens = r.prompt_ids + r.output_ids[:-1]
    return tokens[r.cached_len:]


def _slots_needed(unit: list[Request]) -> int:
    return sum(r.slot is None for r in unit)


def _step_inputs(requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
    """Host tensors ints [7,B] (tokens left 0, positions, slots, top_k, seeds, prompt groups and
    their shared prompt lengths), floats [2,B]."""
    ints = torch.tensor([[0, r.cached_len, r.slot, r.params.top_k, r.seed, r.prompt_group, r.shared_prompt]
                         for r in requests], dtype=torch.int64).T.contiguous()
    floats = torch.tensor([[r.params.temperature, r.params.top_p] for r in requests],
                          dtype=torch.float32).T.contiguous()
    return ints, floats


def _mode(requests: list[Request]) -> str:
    return batch_mode([r.params.temperature for r in requests], [r.params.top_k for r in requests],
                      [r.params.top_p for r in requests])


def with_blas_library(fn: Callable, library: str | None) -> Callable:
    """``fn`` run with ``library`` as torch's preferred BLAS (restored after), or ``fn`` itself for
    None. A CUDA graph captured inside keeps that library's kernels."""
    if library is None:
        return fn

    def run(*args, **kwargs):
        previous = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(library)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.backends.cuda.preferred_blas_library(previous)

    return run
