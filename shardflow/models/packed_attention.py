"""Attention over packed tokens where each query sequence reads its own list of key tokens.

A micro-batch whose samples share a prompt holds the prompt's tokens once (see
``engine.shared_prompts``): the packed row is [prompt, sample 1's own tokens, sample 2's, ...].
Query sequence ``s`` is the packed tokens ``cu_q[s]:cu_q[s+1]``; it attends to the packed tokens
``kv_index[cu_k[s]:cu_k[s+1]]`` (the prompt's, then its own), causally with the two aligned at their
ends: the query at offset ``j`` of a sequence of ``len_q`` sees keys at offsets up to
``j + len_k - len_q``. A prompt is its own sequence (``kv`` = itself), so every packed token is a
query exactly once and sees exactly the tokens, at the same positions, that it sees in its
unshared sequence.

On CUDA in half precision this is flash attention's variable-length kernel; elsewhere (CPU, float32)
one ``scaled_dot_product_attention`` over the sequences padded to the longest, with a mask.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PackedSequences:
    kv_index: torch.Tensor  # [N_kv] int64: packed token of each key slot, sequence after sequence
    cu_q: torch.Tensor  # [S+1] int32: query sequence starts in the packed tokens
    cu_k: torch.Tensor  # [S+1] int32: key sequence starts in kv_index
    max_q: int  # longest query sequence
    max_k: int  # longest key sequence
    # The key gather's backward, without atomics over every slot: each token takes the gradient of
    # its first slot, then the few repeated slots (a shared prompt's, once per sample) are added.
    first_slot: torch.Tensor  # [N] int64: the first key slot of each packed token
    extra_slot: torch.Tensor  # [N_kv - N] int64: every other key slot...
    extra_token: torch.Tensor  # [N_kv - N] int64: ...and its token

    @classmethod
    def build(cls, kv_index: torch.Tensor, q_lens: list[int], k_lens: list[int]) -> "PackedSequences":
        """From the key slots' tokens and the sequences' query and key lengths (host values)."""
        cumsum = lambda n: torch.tensor([0, *n], dtype=torch.int32).cumsum(0, dtype=torch.int32)  # noqa: E731
        tokens, slots = sum(q_lens), torch.arange(len(kv_index))
        first = torch.full((tokens,), len(kv_index), dtype=torch.long)
        first.scatter_reduce_(0, kv_index, slots, "amin")
        if len(kv_index) and (first == len(kv_index)).any():
            raise ValueError("every packed token must be a key of some sequence (its own is enough)")
        extra = slots[first[kv_index] != slots]
        return cls(kv_index, cumsum(q_lens), cumsum(k_lens), max(q_lens), max(k_lens), first, extra, kv_index[extra])

    def to(self, device: torch.device | str) -> "PackedSequences":
        move = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()}
        return PackedSequences(**move)


class _GatherKeys(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, seqs: PackedSequences) -> torch.Tensor:
        ctx.seqs = seqs
        return x.index_select(0, seqs.kv_index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        seqs = ctx.seqs
        out = grad.index_select(0, seqs.first_slot)
        return out.index_add_(0, seqs.extra_token, grad.index_select(0, seqs.extra_slot)), None


def gather_keys(x: torch.Tensor, seqs: PackedSequences) -> torch.Tensor:
    """[N,...] packed tokens -> [N_kv,...] key slots, sequence after sequence."""
    return _GatherKeys.apply(x, seqs)


@torch.compiler.disable  # its sizes are Python ints that change per micro-batch: keep them out of graphs
def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSequences) -> torch.Tensor:
    """q [N,h,d], k and v [N,k,d] (packed tokens) -> [N,h,d]."""
    k, v = gather_keys(k, seqs), gather_keys(v, seqs)  # [N_kv,k,d]
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return _flash_varlen(q, k, v, seqs)
    return _padded_sequences(q, k, v, seqs)


def _flash_varlen(q, k, v, seqs: PackedSequences) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    extra = {"enable_gqa": True} if _varlen_takes_gqa() and q.shape[1] != k.shape[1] else {}
    # window (-1, 0): causal, aligned at the sequences' ends when queries are fewer than keys
    return varlen_attn(q, k, v, seqs.cu_q, seqs.cu_k, seqs.max_q, seqs.max_k, window_size=(-1, 0), **extra)


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
