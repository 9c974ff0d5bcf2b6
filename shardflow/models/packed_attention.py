"""Attention over packed tokens where each query sequence reads its own list of key tokens.

A micro-batch whose samples share a prompt holds the prompt's tokens once (see
``engine.shared_prompts``): the packed row is [prompt, sample 1's own tokens, sample 2's, ...].
Query sequence ``s`` is the packed tokens ``cu_q[s]:cu_q[s+1]``; it attends to the packed tokens
``kv_index[cu_k[s]:cu_k[s+1]]`` (the prompt's, then its own), causally with the two aligned at their
ends: the query at offset ``j`` of a sequence of ``len_q`` sees keys at offsets up to
``j + len_k - len_q``. A prompt is its own sequence (``kv`` = itself), so every packed token is a
query exactly once and sees exactly the tokens, at the same positions, that it sees in its
unshared sequence.

Kernels (``kernel`` of ``PackedSequences``), on CUDA in half precision:
- ``rows``: each sample becomes one row of its key tokens (its prompt, then its own tokens), the
  rows padded to the longest, and one causal ``scaled_dot_product_attention`` runs over them
  (cuDNN's fused kernel on Hopper, about twice as fast there as flash attention's variable-length
  one: ``bench/train_attention.py``); each packed token's output is taken from the row holding its
  query, a prompt's from the row of one of its samples. A prompt's queries are computed again in
  each of its samples' rows (p^2/2 pairs against a sample's n^2/2), and padding costs its pairs.
- ``varlen``: the keys gathered per sequence (a prompt's once per sample), then flash attention's
  variable-length kernel: no padding, nothing computed twice.
- ``fa4``: the same layout as ``varlen`` through FlashAttention-4's variable-length kernels (the
  optional ``flash-attn-4`` package, CuTe DSL; compute capability 9.x and 10.x): GQA inside the
  kernel, no padding, nothing computed twice, no queries gathered. On an H100 it is faster than
  ``rows`` (``bench/shared_prompts.py``: attention of one layer 16% and 7% faster on the two GRPO
  workloads, their training steps 3.8% and 1.2%). Its kernels are compiled at their first call
  (seconds; cached on disk with the run's compile cache).
- ``auto``: ``fa4`` where it is installed and runs (Hopper, and Blackwell, which is not measured
  here; the head dimensions its kernels take); else ``rows`` where attention runs cuDNN's kernel
  (compute capability 9.0 and up) and the rows' padded pairs are at most ``ROWS_SPEEDUP`` times the
  sequences' own; else ``varlen``.
Elsewhere (CPU, float32) every kernel is one masked ``scaled_dot_product_attention`` over the
sequences padded to the longest.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from shardflow.data.batch import to_device

KERNELS = ("auto", "rows", "varlen", "fa4")
# cuDNN's causal attention over padded rows against flash attention's variable-length kernel over
# the same sequences, forward + backward on an H200 (bench/train_attention.py, Qwen3 heads):
# 1.9x on the GRPO iteration's micro-batch, 1.85x on 1224-token sequences. Rows win while their
# padding costs less than that.
ROWS_SPEEDUP = 1.8
# cuDNN's attention builds a plan for every new shape it meets: about 90 ms (forward and backward,
# an H200) against about 1 ms for the call itself at the GRPO micro-batch's shape. Rows of attention
# on a GPU (the rows kernel's, and padded micro-batches') are therefore as long as a multiple of
# LENGTH_MULTIPLE, and the rows kernel's rows as many as a multiple of ROWS_MULTIPLE: shapes then
# repeat across micro-batches and iterations, and each plan is built once. The padding costs less:
# at most 63 positions after a row's real tokens (no real query reads them) and at most 3 rows.
LENGTH_MULTIPLE = 64
ROWS_MULTIPLE = 4


@dataclass(frozen=True)
class Gather:
    """``x[index]`` for packed tokens ``x`` [N, ...], whose backward gathers each token's gradient
    from its first slot and adds the few repeated slots (a shared prompt's, once per sample)
    instead of atomics over every slot. Slots whose gradient is zero by construction (``live``
    false: padding, queries whose outputs are dropped) are left out of backward."""

    index: torch.Tensor  # [M] int64: the packed token of each slot
    first_slot: torch.Tensor  # [N] int64: the first live slot of each packed token
    extra_slot: torch.Tensor  # int64: every other live slot...
    extra_token: torch.Tensor  # int64: ...and its token

    @classmethod
    def build(cls, index: torch.Tensor, tokens: int, live: torch.Tensor | None = None) -> "Gather":
        slots = torch.arange(len(index))
        live = torch.ones(len(index), dtype=torch.bool) if live is None else live
        first = torch.full((tokens,), len(index), dtype=torch.long)
        first.scatter_reduce_(0, index[live], slots[live], "amin")
        if tokens and (first == len(index)).any():
            raise ValueError("every packed token must be a key of some sequence (its own is enough)")
        extra = slots[live & (first[index] != slots)]
        return cls(index, first, extra, index[extra])

    @classmethod
    def single(cls, index: torch.Tensor, slot: torch.Tensor) -> "Gather":
        """``build`` where token ``t``'s one live slot is ``slot[t]`` (``index[slot[t]] == t``)."""
        return cls(index, slot, index[:0], index[:0])

    def to(self, device: torch.device | str) -> "Gather":
        return Gather(*(to_device(t, device) for t in (self.index, self.first_slot, self.extra_slot, self.extra_token)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _Gather.apply(x, self)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, gather: Gather) -> torch.Tensor:
        ctx.gather = gather
        return x.index_select(0, gather.index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = ctx.gather
        out = grad.index_select(0, g.first_slot)
        if len(g.extra_slot):
            out.index_add_(0, g.extra_token, grad.index_select(0, g.extra_slot))
        return out, None


@dataclass(frozen=True)
class Rows:
    """The sequences as rows of their key tokens for the ``rows`` kernel: ``keys`` makes the
    [R * length] row slots of k and v (padding after each row's tokens, and whole rows of it to make R
    and length multiples of ROWS_MULTIPLE and LENGTH_MULTIPLE, read token 0, seen by no real query),
    ``queries`` the same slots of q, ``query_slot`` is the slot holding each packed token's query,
    ``dropped_slot`` the other slots (padding, a prompt's queries again in its other samples' rows).
    Only the query slots' outputs are kept, so only they have query gradients, and padding slots
    have no key gradients: both gathers' backwards skip the slots they know to be zero."""

    keys: Gather
    queries: Gather
    length: int
    query_slot: torch.Tensor  # [N] int64
    dropped_slot: torch.Tensor  # [R * length - N] int64
    pairs: int  # causal (query, key) pairs the padded rows compute

    @classmethod
    def build(cls, kv_index: torch.Tensor, q_lens: list[int], k_lens: list[int]) -> "Rows | None":
        """None unless each sequence's last key slots are its own queries, in order."""
        cu_q = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
        cu_k = [0, *torch.tensor(k_lens).cumsum(0).tolist()]
        keys = [kv_index[cu_k[s]:cu_k[s + 1]] for s in range(len(q_lens))]
        for s, (lq, lk) in enumerate(zip(q_lens, k_lens)):
            if lk < lq or not torch.equal(keys[s][lk - lq:], torch.arange(cu_q[s], cu_q[s] + lq)):
                return None
        # A sequence without a prefix (a prompt) rides in the row of one that begins with its tokens.
        starting = {}
        for s, (lq, lk) in enumerate(zip(q_lens, k_lens)):
            if lk > lq:
                starting.setdefault(int(keys[s][0]), []).append(s)
        host = {}
        for s, (lq, lk) in enumerate(zip(q_lens, k_lens)):
            if lk == lq:
                host[s] = next((t for t in starting.get(cu_q[s], []) if k_lens[t] >= lq
                                and torch.equal(keys[t][:lq], keys[s])), s)
        rows = [s for s in range(len(q_lens)) if host.get(s, s) == s]
        row_of = {s: r for r, s in enumerate(rows)}
        length = -(-max(k_lens[s] for s in rows) // LENGTH_MULTIPLE) * LENGTH_MULTIPLE
        count = -(-len(rows) // ROWS_MULTIPLE) * ROWS_MULTIPLE  # rows past the sequences' are all padding
        index = torch.zeros(count, length, dtype=torch.long)
        real = torch.zeros(count, length, dtype=torch.bool)
        for r, s in enumerate(rows):
            index[r, :k_lens[s]] = keys[s]
            real[r, :k_lens[s]] = True
        query_slot = torch.empty(cu_q[-1], dtype=torch.long)
        for s, (lq, lk) in enumerate(zip(q_lens, k_lens)):
            r = row_of[host.get(s, s)]
            at = r * length + (lk - lq if host.get(s, s) == s else 0)
            query_slot[cu_q[s]:cu_q[s] + lq] = torch.arange(at, at + lq)
        keys = Gather.build(index.flatten(), cu_q[-1], real.flatten())
        dropped = torch.ones(count * length, dtype=torch.bool)
        dropped[query_slot] = False
        return cls(keys, Gather.single(keys.index, query_slot), length, query_slot, dropped.nonzero()[:, 0],
                   count * length * (length + 1) // 2)

    def to(self, device: torch.device | str) -> "Rows":
        keys, query_slot = self.keys.to(device), to_device(self.query_slot, device)
        return Rows(keys, Gather.single(keys.index, query_slot), self.length, query_slot,
                    to_device(self.dropped_slot, device), self.pairs)


@dataclass(frozen=True)
class PackedSequences:
    keys: Gather  # [N_kv] key slots, sequence after sequence
    cu_q: torch.Tensor  # [S+1] int32: query sequence starts in the packed tokens
    cu_k: torch.Tensor  # [S+1] int32: key sequence starts in the key slots
    max_q: int  # longest query sequence
    max_k: int  # longest key sequence
    pairs: int  # (query, key) pairs the sequences attend to
    rows: Rows | None  # the sequences as rows (kernel ``rows``), where they allow it
    kernel: str = "auto"  # see the module's note

    @classmethod
    def build(cls, kv_index: torch.Tensor, q_lens: list[int], k_lens: list[int], *,
              kernel: str = "auto") -> "PackedSequences":
        """From the key slots' tokens and the sequences' query and key lengths (host values)."""
        check_kernel(kernel)
        cumsum = lambda n: torch.tensor([0, *n], dtype=torch.int32).cumsum(0, dtype=torch.int32)  # noqa: E731
        pairs = sum(lq * (lk - lq) + lq * (lq + 1) // 2 for lq, lk in zip(q_lens, k_lens))
        rows = Rows.build(kv_index, q_lens, k_lens)
        if kernel == "rows" and rows is None:
            raise ValueError("the rows kernel needs sequences whose last keys are their own queries")
        return cls(Gather.build(kv_index, sum(q_lens)), cumsum(q_lens), cumsum(k_lens), max(q_lens), max(k_lens),
                   pairs, rows, kernel)

    @property
    def kv_index(self) -> torch.Tensor:
        return self.keys.index

    def to(self, device: torch.device | str) -> "PackedSequences":
        return PackedSequences(self.keys.to(device), to_device(self.cu_q, device), to_device(self.cu_k, device),
                               self.max_q, self.max_k, self.pairs,
                               self.rows.to(device) if self.rows is not None else None, self.kernel)

    def kernel_on(self, device: torch.device, head_dim: int) -> str:
        """The kernel that runs on ``device`` for heads of ``head_dim`` (see the module's note)."""
        if self.kernel != "auto":
            return self.kernel
        if fa4_runs(device, head_dim):
            return "fa4"
        if self.rows is not None and self.rows.pairs <= ROWS_SPEEDUP * self.pairs and _cudnn_attention(device):
            return "rows"
        return "varlen"


def gather_keys(x: torch.Tensor, seqs: PackedSequences) -> torch.Tensor:
    """[N,...] packed tokens -> [N_kv,...] key slots, sequence after sequence."""
    return seqs.keys(x)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSequences) -> torch.Tensor:
    """q [N,h,d], k and v [N,k,d] (packed tokens) -> [N,h,d]."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        kernel = seqs.kernel_on(q.device, q.shape[-1])
        if kernel == "rows":
            return attend_rows(q, k, v, seqs.rows)
        varlen = _fa4_varlen if kernel == "fa4" else _flash_varlen
        return varlen(q, seqs.keys(k), seqs.keys(v), seqs)
    return _padded_sequences(q, seqs.keys(k), seqs.keys(v), seqs)


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Rows) -> torch.Tensor:
    """The ``rows`` kernel: q [N,h,d], k and v [N,k,d] -> [N,h,d]."""
    qs, ks, vs = (g(t).unflatten(0, (-1, rows.length)).transpose(1, 2)
                  for g, t in ((rows.queries, q), (rows.keys, k), (rows.keys, v)))
    out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return _Select.apply(out.transpose(1, 2).flatten(0, 1), rows.query_slot, rows.dropped_slot)  # -> [N,h,d]


class _Select(torch.autograd.Function):
    """``x[slots]`` for distinct ``slots``, the other rows of x being ``dropped``: backward writes
    each gradient to its slot and zeros to the dropped rows (two writes of each row at most, where
    ``index_select``'s backward adds into zeros with atomics)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, slots: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
        ctx.rows, ctx.slots, ctx.dropped = x.shape[0], slots, dropped
        return x.index_select(0, slots)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(ctx.rows, *grad.shape[1:]).index_copy_(0, ctx.slots, grad)
        return out.index_fill_(0, ctx.dropped, 0), None, None


@lru_cache(maxsize=None)
def _cudnn_attention(device: torch.device) -> bool:
    """Whether causal attention on ``device`` runs cuDNN's fused kernel (Hopper and later)."""
    return (device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled()
            and torch.cuda.get_device_capability(device) >= (9, 0))


def _flash_varlen(q, k, v, seqs: PackedSequences) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    extra = {"enable_gqa": True} if _varlen_takes_gqa() and q.shape[1] != k.shape[1] else {}
    # window (-1, 0): causal, aligned at the sequences' ends when queries are fewer than keys
    return varlen_attn(q, k, v, seqs.cu_q, seqs.cu_k, seqs.max_q, seqs.max_k, window_size=(-1, 0), **extra)


@lru_cache(maxsize=1)
def fa4_available() -> bool:
    """Whether FlashAttention-4's kernels (``flash_attn.cute``, the ``flash-attn-4`` package) can be imported."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:  # no flash_attn at all
        return False


@lru_cache(maxsize=None)
def fa4_runs(device: torch.device, head_dim: int) -> bool:
    """Whether ``auto`` picks FlashAttention-4 on ``device`` for heads of ``head_dim``: installed, and
    a device and head size its kernels take (Hopper: 8-256; Blackwell: 8-128 or 256; multiples of 8)."""
    if device.type != "cuda" or head_dim % 8 or not fa4_available():
        return False
    major = torch.cuda.get_device_capability(device)[0]
    return (major == 9 and 8 <= head_dim <= 256) or (major == 10 and (8 <= head_dim <= 128 or head_dim == 256))


def check_kernel(kernel: str) -> None:
    """A clear error, before any work, for a kernel that is unknown or whose package is missing."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown packed attention kernel {kernel!r}; one of {', '.join(KERNELS)}")
    if kernel == "fa4" and not fa4_available():
        raise ValueError("packed attention kernel 'fa4' needs FlashAttention-4 (pip install flash-attn-4: the "
                         "flash_attn.cute module), which is not installed")


def _fa4_varlen(q, k, v, seqs: PackedSequences) -> torch.Tensor:
    from flash_attn.cute import flash_attn_varlen_func

    # causal with fewer queries than keys: aligned at the sequences' ends, as varlen_attn's window
    out, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q=seqs.cu_q, cu_seqlens_k=seqs.cu_k, max_seqlen_q=seqs.max_q,
                                    max_seqlen_k=seqs.max_k, causal=True)
    return out


@lru_cache(maxsize=1)
def _varlen_takes_gqa() -> bool:
    """torch 2.13 asks for ``enable_gqa``; 2.11 passes fewer KV heads to the kernel as they are."""
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def _padded_sequences(q, k, v, seqs: PackedSequences) -> torch.Tensor:
    """The sequences padded to [S, longest] and one masked ``scaled_dot_product_attention``."""
    cu_q, cu_k = seqs.cu_q.long(), seqs.cu_k.long()
    len_q, len_k = cu_q.diff(), cu_k.diff()  # [S]
    jq = torch.arange(seqs.max_q, device=q.device)
    jk = torch.arange(seqs.max_k, device=q.device)
    valid_q, valid_k = jq < len_q[:, None], jk < len_k[:, None]  # [S,max_q], [S,max_k]
    rows_q = torch.where(valid_q, cu_q[:-1, None] + jq, 0)
    rows_k = torch.where(valid_k, cu_k[:-1, None] + jk, 0)
    # query j of a sequence sees its keys up to j + len_k - len_q; padded queries see every key
    # (their rows are dropped) so that no row is empty
    sees = jk <= jq[:, None] + (len_k - len_q)[:, None, None]  # [S,max_q,max_k]
    mask = (sees & valid_k[:, None, :]) | ~valid_q[:, :, None]
    qs, ks, vs = (t[i].transpose(1, 2) for t, i in ((q, rows_q), (k, rows_k), (v, rows_k)))  # [S,heads,len,d]
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask[:, None], enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)[valid_q]  # [N,h,d]: the sequences' queries are the packed tokens in order
