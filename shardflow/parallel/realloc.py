"""Parameter reallocation: run a transfer plan on gloo or NCCL.

Every rank of the source or destination layout calls ``reallocate`` with its own tensors in each
layout. What the rank already holds is copied locally (on a side stream under CUDA) while the
first messages are in flight; the rest moves point-to-point on the default group, batched:

- the transfers between one (src, dst) pair are cut into buckets of at most ``bucket_bytes``;
  inside a bucket, a transfer contiguous at both ends and at least ``direct_min_bytes`` long is
  sent straight from the source tensor into the destination tensor, and the others are packed
  into one flat buffer (one message). Sender and receiver derive the same buckets from the plan.
- round i posts bucket i of every peer of this rank, both directions, in one batch
  (``comm.batch_isend_irecv``); two rounds are in flight, so packing the next round and
  unpacking the last one overlap the transfer of the current one.

No process group beyond the default one is needed. Under NCCL the default group must already
be initialised on every rank (``init_world`` binds the device, which does that), since batched
point-to-point among a subset of ranks may not be a group's first operation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import deque
from dataclasses import dataclass
from functools import lru_cache

import torch

from shardflow.config.model import ModelConfig
from shardflow.parallel import comm
from shardflow.parallel.layout import Layout
from shardflow.parallel.offload import has_storage, regrow_storage, release_storage
from shardflow.parallel.realloc_plan import Transfer, TransferPlan, transfer_plan
from shardflow.parallel.sharding import shard_for

BUCKET_BYTES = 128 << 20  # bytes per peer and direction in one round (two rounds are in flight)
DIRECT_MIN_BYTES = 1 << 20  # a contiguous slice at least this long skips packing
ROUNDS_IN_FLIGHT = 2


@dataclass(frozen=True, kw_only=True)
class ReallocStats:
    """What one rank did in one reallocation."""

    bytes_sent: int
    bytes_received: int
    bytes_copied: int  # local copies (the rank already held the slice)
    messages: int  # point-to-point messages posted (sends + receives)
    seconds: float

    @property
    def gbps(self) -> float:
        """Achieved bandwidth of this rank's busier direction, in GB/s (1e9 bytes)."""
        moved = max(self.bytes_sent, self.bytes_received)
        return moved / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        return (f"sent {self.bytes_sent / 1e6:.1f} MB, received {self.bytes_received / 1e6:.1f} MB, "
                f"copied {self.bytes_copied / 1e6:.1f} MB in {self.messages} messages, "
                f"{self.seconds * 1e3:.1f} ms, {self.gbps:.2f} GB/s")


# ----- the message schedule (a pure function of the plan, identical at both ends) ------------


@dataclass(frozen=True)
class _Message:
    transfers: tuple[Transfer, ...]
    direct: bool  # one transfer, sent from / received into the tensors themselves
    numel: int


@dataclass(frozen=True)
class _Round:
    sends: tuple[tuple[int, tuple[_Message, ...]], ...]  # (peer, messages to it)
    recvs: tuple[tuple[int, tuple[_Message, ...]], ...]  # (peer, messages from it)


def _contiguous_narrow(shape: tuple[int, ...], t: Transfer) -> bool:
    """Is ``narrow(dim, start, length)`` of a contiguous tensor of ``shape`` contiguous?"""
    if t.dim is None or t.length == shape[t.dim]:
        return True
    outer = 1
    for s in shape[: t.dim]:
        outer *= s
    return outer == 1


def _chunks(t: Transfer, max_numel: int) -> list[Transfer]:
    """Split a transfer along its dim into pieces of at most ``max_numel`` (at least one slab)."""
    if t.dim is None or t.numel <= max_numel:
        return [t]
    slab = t.numel // t.length
    step = max(1, max_numel // slab)
    pieces = []
    for off in range(0, t.length, step):
        n = min(step, t.length - off)
        shape = tuple(n if d == t.dim else s for d, s in enumerate(t.shape))
        pieces.append(dataclasses.replace(t, src_start=t.src_start + off, dst_start=t.dst_start + off,
                                          length=n, numel=n * slab, shape=shape))
    return pieces


@lru_cache(maxsize=256)
def _pair_buckets(plan: TransferPlan, src_rank: int, dst_rank: int, itemsize: int, bucket_bytes: int,
                  direct_min_bytes: int) -> tuple[tuple[_Message, ...], ...]:
    """The messages from ``src_rank`` to ``dst_rank``, grouped into buckets."""
    src_shapes = {n: ts.local_shape for n, ts in shard_for(plan.cfg, plan.src, src_rank).tensors.items()}
    dst_shapes = {n: ts.local_shape for n, ts in shard_for(plan.cfg, plan.dst, dst_rank).tensors.items()}
    max_numel = max(1, bucket_bytes // itemsize)
    buckets: list[tuple[_Message, ...]] = []
    direct: list[_Message] = []
    packed: list[Transfer] = []
    size = 0

    def close() -> None:
        nonlocal direct, packed, size
        msgs = list(direct)
        if packed:
            msgs.append(_Message(tuple(packed), False, sum(t.numel for t in packed)))
        if msgs:
            buckets.append(tuple(msgs))
        direct, packed, size = [], [], 0

    for transfer in plan.by_pair.get((src_rank, dst_rank), ()):
        whole = (transfer.numel * itemsize >= direct_min_bytes
                 and _contiguous_narrow(src_shapes[transfer.src_name], transfer)
                 and _contiguous_narrow(dst_shapes[transfer.name], transfer))
        for t in [transfer] if whole else _chunks(transfer, max_numel):
            if size and size + t.numel > max_numel:
                close()
            if whole:
                direct.append(_Message((t,), True, t.numel))
            else:
                packed.append(t)
            size += t.numel
    close()
    return tuple(buckets)


@lru_cache(maxsize=256)
def _rounds(plan: TransferPlan, rank: int, itemsize: int, bucket_bytes: int,
            direct_min_bytes: int) -> tuple[_Round, ...]:
    sends = {p: _pair_buckets(plan, rank, p, itemsize, bucket_bytes, direct_min_bytes)
             for p in sorted(plan.sends(rank))}
    recvs = {p: _pair_buckets(plan, p, rank, itemsize, bucket_bytes, direct_min_bytes)
             for p in sorted(plan.recvs(rank))}
    count = max([len(b) for b in (*sends.values(), *recvs.values())], default=0)
    return tuple(
        _Round(sends=tuple((p, b[i]) for p, b in sends.items() if i < len(b)),
               recvs=tuple((p, b[i]) for p, b in recvs.items() if i < len(b)))
        for i in range(count)
    )


# ----- checks (before any communication) ------------------------------------------------------


def _check_params(cfg: ModelConfig, layout: Layout, rank: int, params: dict[str, torch.Tensor] | None,
                  role: str) -> None:
    if rank not in layout:
        if params:
            raise ValueError(f"rank {rank} is not in the {role} layout {layout} but was given {role} tensors")
        return
    if params is None:
        raise ValueError(f"rank {rank} is in the {role} layout {layout} but was given no {role} tensors")
    shard = shard_for(cfg, layout, rank)
    missing = [n for n in shard.tensors if n not in params]
    extra = [n for n in params if n not in shard.tensors]
    if missing or extra:
        raise ValueError(f"{role} tensors on rank {rank} do not match {layout} of this model: "
                         f"missing {missing[:3]}, unexpected {extra[:3]} (a different model?)")
    for name, ts in shard.tensors.items():
        t = params[name]
        if tuple(t.shape) != ts.local_shape:
            raise ValueError(f"{role} tensor {name!r} on rank {rank} has shape {list(t.shape)}, expected "
                             f"{list(ts.local_shape)} in {layout} (a different model or layout?)")
        if not t.is_contiguous():
            raise ValueError(f"{role} tensor {name!r} on rank {rank} is not contiguous")


def _check_no_alias(src_params: dict[str, torch.Tensor], dst_params: dict[str, torch.Tensor]) -> None:
    """Destination buffers must not share memory with the source tensors they are filled from."""
    spans = []
    for role, params in (("src", src_params), ("dst", dst_params)):
        for name, t in params.items():
            if t.numel() and has_storage(t):
                spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), role, name))
    spans.sort()
    last: dict[str, tuple[int, str]] = {}
    for start, stop, role, name in spans:
        other = "dst" if role == "src" else "src"
        if other in last and start < last[other][0]:
            src_name, dst_name = (name, last[other][1]) if role == "src" else (last[other][1], name)
            raise ValueError(f"destination tensor {dst_name!r} shares memory with source tensor {src_name!r}; "
                             "reallocation needs separate destination buffers")
        if stop > last.get(role, (0, ""))[0]:
            last[role] = (stop, name)


# ----- execution --------------------------------------------------------------------------


def _post(rnd: _Round, src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], dtype: torch.dtype,
          device: torch.device):
    """Pack and post one round; returns what finishing it needs."""
    sends, recvs, unpack = [], [], []
    for peer, messages in rnd.sends:
        for m in messages:
            if m.direct:
                t = m.transfers[0]
                sends.append((t.src_view(src[t.src_name]), peer))
                continue
            buf = torch.empty(m.numel, dtype=dtype, device=device)  # [numel], slices back to back
            offset = 0
            for t in m.transfers:
                buf[offset:offset + t.numel].view(t.shape).copy_(t.src_view(src[t.src_name]))
                offset += t.numel
            sends.append((buf, peer))
    for peer, messages in rnd.recvs:
        for m in messages:
            if m.direct:
                t = m.transfers[0]
                recvs.append((t.dst_view(dst[t.name]), peer))
                continue
            buf = torch.empty(m.numel, dtype=dtype, device=device)
            recvs.append((buf, peer))
            unpack.append((m, buf))
    works = comm.batch_isend_irecv(sends, recvs)
    return works, unpack, sends  # the send buffers stay referenced until the round is waited on


def _finish(works, unpack, dst: dict[str, torch.Tensor]) -> None:
    for w in works:
        w.wait()
    for m, buf in unpack:
        offset = 0
        for t in m.transfers:
            t.dst_view(dst[t.name]).copy_(buf[offset:offset + t.numel].view(t.shape))
            offset += t.numel


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_local(transfers: tuple[Transfer, ...], src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor],
                device: torch.device):
    """Local copies; on CUDA on a side stream so they overlap the transfers. Returns the stream
    to join before the tensors are used again (None on CPU, where they ran here)."""
    stream = None
    if device.type == "cuda" and transfers:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # destination padding zeroed, etc.
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for t in transfers:
            t.dst_view(dst[t.name]).copy_(t.src_view(src[t.src_name]))
    return stream


@torch.no_grad()
def reallocate(world, cfg: ModelConfig, src: Layout, dst: Layout,
               src_params: dict[str, torch.Tensor] | None, dst_params: dict[str, torch.Tensor] | None, *,
               release_src: bool = False, bucket_bytes: int = BUCKET_BYTES,
               direct_min_bytes: int = DIRECT_MIN_BYTES) -> ReallocStats:
    """Fill this rank's destination tensors from the source layout's tensors, in place.

    Every rank of ``src`` or ``dst`` calls this (others may too; they return at once).
    ``src_params`` / ``dst_params``: this rank's ``{HF name: local tensor}`` in each layout, None
    where the rank is not in it. Destination tensors are preallocated (released storage is
    regrown) and filled in place, vocabulary padding rows zeroed. ``release_src``: free the
    source tensors' memory afterwards (the source layout was a temporary one).
    """
    plan = transfer_plan(cfg, src, dst)  # checks that the model splits into both layouts
    for name, layout in (("source", src), ("destination", dst)):
        if max(layout.ranks) >= world.size:
            raise ValueError(f"{name} layout {layout} names rank {max(layout.ranks)}, "
                             f"but the job has {world.size} ranks")
    me = world.rank
    _check_params(cfg, src, me, src_params, "source")
    _check_params(cfg, dst, me, dst_params, "destination")
    src_params, dst_params = src_params or {}, dst_params or {}
    tensors = [*src_params.values(), *dst_params.values()]
    if not tensors:
        return ReallocStats(bytes_sent=0, bytes_received=0, bytes_copied=0, messages=0, seconds=0.0)
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise ValueError(f"source and destination tensors on rank {me} mix dtypes {sorted(map(str, dtypes))}")
    devices = {t.device for t in tensors}
    if devices != {world.device}:
        raise ValueError(f"tensors on rank {me} are on {sorted(map(str, devices))}, expected {world.device}")
    for name, t in src_params.items():
        if not has_storage(t):
            raise ValueError(f"source tensor {name!r} on rank {me} has no storage (released or offloaded)")
    _check_no_alias(src_params, dst_params)
    [dtype], itemsize = dtypes, tensors[0].element_size()

    _sync(world.device)
    start = time.perf_counter()
    if me in dst:
        for name, ts in shard_for(cfg, dst, me).tensors.items():
            t = dst_params[name]
            regrow_storage(t)
            if ts.padded:
                n = ts.stop - ts.start
                t.narrow(ts.dim, n, ts.local_shape[ts.dim] - n).zero_()
    rounds = _rounds(plan, me, itemsize, bucket_bytes, direct_min_bytes)
    messages, in_flight, side = 0, deque(), None
    for i, rnd in enumerate(rounds):
        in_flight.append(_post(rnd, src_params, dst_params, dtype, world.device))
        messages += sum(len(m) for _, m in rnd.sends) + sum(len(m) for _, m in rnd.recvs)
        if i == 0:  # the first round is on its way: copy what this rank already holds meanwhile
            side = _copy_local(plan.local(me), src_params, dst_params, world.device)
        if len(in_flight) == ROUNDS_IN_FLIGHT:
            works, unpack, _ = in_flight.popleft()
            _finish(works, unpack, dst_params)
    if not rounds:
        side = _copy_local(plan.local(me), src_params, dst_params, world.device)
    while in_flight:
        works, unpack, _ = in_flight.popleft()
        _finish(works, unpack, dst_params)
    if side is not None:
        torch.cuda.current_stream(world.device).wait_stream(side)
    copied = sum(t.numel for t in plan.local(me))
    if release_src:
        release_storage(src_params.values())
    _sync(world.device)
    seconds = time.perf_counter() - start

    sent = sum(t.numel for ts in plan.sends(me).values() for t in ts)
    received = sum(t.numel for ts in plan.recvs(me).values() for t in ts)
    return ReallocStats(bytes_sent=sent * itemsize, bytes_received=received * itemsize,
                        bytes_copied=copied * itemsize, messages=messages, seconds=seconds)
