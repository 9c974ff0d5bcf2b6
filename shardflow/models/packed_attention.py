"""Attention over a packed row in which the samples of a prompt hold one copy of it.

A micro-batch whose samples share a prompt holds the prompt's tokens once (see
``engine.shared_prompts``). The packed row is every prompt first (``prompt_tokens`` of them), then
every sample's own tokens. A prompt's token attends causally within its prompt; a sample's token
attends to its whole prompt and causally to its sample's own tokens. So every packed token is a
query exactly once and sees exactly the tokens, at the same positions, that it sees in its
unshared sequence.

That is three attentions over contiguous slices of the row, with no keys copied: the prompts, each
causal over itself; the samples' own tokens, each sample causal over itself; and those same tokens
(one query sequence per prompt: its samples' together) over their prompt, without a mask, since a
prompt precedes all of its samples' tokens. The last two merge by log-sum-exp. Backward runs each
attention's own backward against the merged output and log-sum-exp, which gives each part's share of
the exact gradient (the softmax probabilities and the row term ``sum(dO * O)`` of a flash backward
are then those of the merged attention).

On CUDA in half precision these are flash attention's variable-length kernels (aten's); elsewhere
the same arithmetic in torch ops over the sequences padded to the longest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from shardflow.engine.compile_fallback import compiled_or_eager


@dataclass(frozen=True)
class PackedSequences:
    prompt_tokens: int  # the row's first tokens, every prompt; the samples' own tokens follow
    cu_prompt: torch.Tensor  # [G+1] int32: each prompt's start
    cu_sample: torch.Tensor  # [S+1] int32: each sample's own tokens' start, from prompt_tokens on
    cu_own: torch.Tensor  # [G+1] int32: each prompt's samples' own tokens' start, from prompt_tokens on
    max_prompt: int
    max_sample: int
    max_own: int

    @classmethod
    def build(cls, prompt_lens: list[int], sample_lens: list[int], own_lens: list[int]) -> "PackedSequences":
        """From host lengths: each prompt, each sample's own tokens (samples with some, in row
        order), and each prompt's samples' own tokens together."""
        if len(own_lens) != len(prompt_lens) or min(prompt_lens, default=0) < 1 or sum(own_lens) != sum(sample_lens):
            raise ValueError("every prompt needs a token, and its samples' own tokens must be the samples'")
        cumsum = lambda n: torch.tensor([0, *n], dtype=torch.int32).cumsum(0, dtype=torch.int32)  # noqa: E731
        return cls(sum(prompt_lens), cumsum(prompt_lens), cumsum(sample_lens), cumsum(own_lens),
                   max(prompt_lens), max(sample_lens, default=0), max(own_lens))

    def to(self, device: torch.device | str) -> "PackedSequences":
        move = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()}
        return PackedSequences(**move)


@torch.compiler.disable  # its sizes are Python ints that change per micro-batch: keep them out of graphs
def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSequences) -> torch.Tensor:
    """q [N,h,d], k and v [N,k,d] (packed tokens) -> [N,h,d]."""
    return _SharedPromptAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), seqs)


class _SharedPromptAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seqs: PackedSequences):
        r = seqs.prompt_tokens
        out, lse_p, aux = _attend(q[:r], k[:r], v[:r], *_prompts(seqs), causal=True)
        lse_s, aux_sample, aux_cross = lse_p[:, :0], (), ()
        if r < q.shape[0]:
            out_s, lse_s, aux_sample = _attend(q[r:], k[r:], v[r:], *_samples(seqs), causal=True)
            out_c, lse_c, aux_cross = _attend(q[r:], k[:r], v[:r], *_cross(seqs), causal=False)
            out, lse_s = _fused(_merge, q)(out, out_s, lse_s, out_c, lse_c)
        ctx.seqs, ctx.num_aux = seqs, (len(aux), len(aux_sample))
        ctx.save_for_backward(q, k, v, out, lse_p, lse_s, *aux, *aux_sample, *aux_cross)
        return out

    @staticmethod
    def backward(ctx, d_out):
        seqs, r = ctx.seqs, ctx.seqs.prompt_tokens
        q, k, v, out, lse_p, lse_s, *aux = ctx.saved_tensors
        a, b = ctx.num_aux
        d_out = d_out.contiguous()
        part = lambda t: (t[:r], t[r:])  # noqa: E731 - prompts, samples' own tokens
        (q_p, q_s), (k_p, k_s), (v_p, v_s), (o_p, o_s), (g_p, g_s) = map(part, (q, k, v, out, d_out))
        grads = _attend_backward(g_p, q_p, k_p, v_p, o_p, lse_p, *_prompts(seqs), True, aux[:a])
        if r == q.shape[0]:
            return *grads, None
        grads_s = _attend_backward(g_s, q_s, k_s, v_s, o_s, lse_s, *_samples(seqs), True, aux[a:a + b])
        grads_c = _attend_backward(g_s, q_s, k_p, v_p, o_s, lse_s, *_cross(seqs), False, aux[a + b:])
        return *_fused(_combine, q)(*grads, *grads_s, *grads_c), None


def _merge(out_p, out_s, lse_s, out_c, lse_c):
    """The prompts' outputs, then the samples' tokens' two attentions (over themselves, over their
    prompt) merged by log-sum-exp: out [N,h,d] and the merged log-sum-exp [h,N-r]."""
    lse = torch.logaddexp(lse_s, lse_c)
    own, prompt = ((x - lse).exp().T[..., None] for x in (lse_s, lse_c))  # [N-r,h,1]
    return torch.cat([out_p, (out_s.float() * own + out_c.float() * prompt).to(out_s.dtype)]), lse


def _combine(dq_p, dk_p, dv_p, dq_s, dk_s, dv_s, dq_c, dk_c, dv_c):
    """The three attentions' gradients as the packed row's: the cross attention's queries are the
    samples' tokens, its keys the prompts'."""
    return torch.cat([dq_p, dq_s + dq_c]), torch.cat([dk_p + dk_c, dk_s]), torch.cat([dv_p + dv_c, dv_s])


def _fused(fn, like: torch.Tensor):
    """``fn`` compiled on CUDA, where its elementwise passes over [N,h,d] become one kernel; eager
    elsewhere."""
    return _compiled(fn) if like.is_cuda else fn


@lru_cache(maxsize=None)
def _compiled(fn):
    return compiled_or_eager(fn, f"packed attention's {fn.__name__}", dynamic=True)


def _prompts(seqs: PackedSequences) -> tuple:
    return seqs.cu_prompt, seqs.cu_prompt, seqs.max_prompt, seqs.max_prompt


def _samples(seqs: PackedSequences) -> tuple:
    return seqs.cu_sample, seqs.cu_sample, seqs.max_sample, seqs.max_sample


def _cross(seqs: PackedSequences) -> tuple:
    return seqs.cu_own, seqs.cu_prompt, seqs.max_own, seqs.max_prompt


def _use_flash(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _attend(q, k, v, cu_q, cu_k, max_q: int, max_k: int, causal: bool):
    """Variable-length attention of query sequences over key sequences (causal: the two are the
    same sequences). Returns out [Nq,h,d], its log-sum-exp [h,Nq] float32, and what the backward
    needs besides."""
    if _use_flash(q):
        # fewer KV heads than query heads go to the kernel as they are (it groups them)
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False)
        return out, lse, (rng, unused)
    return (*_reference_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal), ())


def _attend_backward(d_out, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, causal: bool, aux):
    """(dq, dk, dv) of ``_attend`` for the given output and log-sum-exp (possibly of a larger
    attention that this one is part of)."""
    if _use_flash(q):
        return torch.ops.aten._flash_attention_backward(d_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k,
                                                         0.0, causal, *aux)
    return _reference_backward(d_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal)


def _padding(cu: torch.Tensor, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows [S, longest] of each sequence (0 where padded) and where they are real."""
    cu = cu.long()
    j = torch.arange(longest, device=cu.device)
    valid = j < cu.diff()[:, None]
    return torch.where(valid, cu[:-1, None] + j, 0), valid


def _probabilities(q, k, cu_q, cu_k, max_q, max_k, causal, lse=None):
    """The padded sequences' queries and keys (heads expanded), and softmax probabilities [S,h,Lq,Lk]:
    normalised by their own log-sum-exp, or by ``lse`` [h,Nq] when given (returned as [Nq,h])."""
    rows_q, valid_q = _padding(cu_q, max_q)
    rows_k, valid_k = _padding(cu_k, max_k)
    group = q.shape[1] // k.shape[1]
    qs = q[rows_q]  # [S,Lq,h,d]
    ks = k[rows_k].repeat_interleave(group, dim=2)  # [S,Lk,h,d]
    sees = valid_k[:, None, None, :]
    if causal:
        sees = sees & (torch.arange(max_k, device=q.device) <= torch.arange(max_q, device=q.device)[:, None])
    scores = torch.einsum("sqhd,skhd->shqk", qs, ks) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~sees, float("-inf"))
    if lse is None:
        norm = torch.logsumexp(scores, dim=-1, keepdim=True)  # [S,h,Lq,1]; padded queries see a key too
        lse = norm.squeeze(-1).transpose(1, 2)[valid_q]  # [Nq,h]
    else:
        norm = torch.where(valid_q[..., None], lse.T[rows_q], 0.0).transpose(1, 2)[..., None]
    probs = (scores - norm).exp() * valid_q[:, None, :, None]
    return qs, ks, probs, lse, (rows_q, valid_q, rows_k, valid_k, group)


def _reference_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal):
    _, _, probs, lse, (rows_q, valid_q, rows_k, _, group) = _probabilities(q, k, cu_q, cu_k, max_q, max_k, causal)
    vs = v[rows_k].repeat_interleave(group, dim=2)
    out = torch.einsum("shqk,skhd->sqhd", probs, vs)[valid_q]
    return out, lse.T.contiguous().float()


def _reference_backward(d_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal):
    """Flash attention's backward in torch ops: P from ``lse``, D = rowsum(dO * O) from ``out``."""
    qs, ks, probs, _, (rows_q, valid_q, rows_k, valid_k, group) = _probabilities(
        q, k, cu_q, cu_k, max_q, max_k, causal, lse=lse)
    vs = v[rows_k].repeat_interleave(group, dim=2)
    pad = valid_q[..., None, None]
    d_o = torch.where(pad, d_out[rows_q], 0)  # [S,Lq,h,d]
    row = torch.where(pad, d_out[rows_q] * out[rows_q], 0).sum(-1).transpose(1, 2)[..., None]  # [S,h,Lq,1]
    d_v = torch.einsum("shqk,sqhd->skhd", probs, d_o)
    d_s = probs * (torch.einsum("sqhd,skhd->shqk", d_o, vs) - row) / math.sqrt(q.shape[-1])
    d_q = torch.einsum("shqk,skhd->sqhd", d_s, ks)[valid_q]
    d_k = torch.einsum("shqk,sqhd->skhd", d_s, qs)
    per_kv = lambda t: t.unflatten(2, (k.shape[1], group)).sum(3)[valid_k]  # noqa: E731 - [Nk,k,d]
    return d_q, per_kv(d_k), per_kv(d_v)
