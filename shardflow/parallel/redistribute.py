"""Batch redistribution: move a call's outputs from the producer's DP shards to the consumer's.

A producing call leaves each DP replica's outputs on the replica's last pipeline stage; its tp
index 0 is the replica's *holder*. Every rank of a consuming replica (all its stages and tp
shards) receives that replica's share. Only holders and consumer ranks take part:

1. one ``all_gather_object`` among them exchanges each holder's header: sample ids, lengths,
   field schema and the per-sequence ``meta`` objects (small, and needed by every receiver);
2. every rank computes the same assignment from those headers: sequences (or groups of them, see
   ``keep_together``) largest first onto the consumer replica with the fewest tokens;
3. one batch of point-to-point messages: each holder sends each consumer rank the tensor fields
   of that rank's share, packed into one byte buffer. A holder keeps what its own replica gets.

The group of step 1 must exist: create ``redistribute_groups(src, dst)`` up front on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import torch
import torch.distributed as dist

from shardflow.data.batch import SequenceBatch
from shardflow.parallel import comm
from shardflow.parallel.layout import Layout

ALIGN = 16  # byte alignment of each field in a packed message, so every dtype can view it


def source_holders(layout: Layout) -> tuple[int, ...]:
    """The rank holding each DP replica's outputs: last stage, tp index 0 (in dp order)."""
    return tuple(layout.rank_at(layout.pp - 1, d, 0) for d in range(layout.dp))


def participants(src: Layout, dst: Layout) -> tuple[int, ...]:
    return tuple(sorted(set(source_holders(src)) | set(dst.ranks)))


def redistribute_groups(src: Layout, dst: Layout) -> list[tuple[int, ...]]:
    """Process groups a redistribution from ``src`` to ``dst`` uses (for ``world.groups.create``)."""
    ranks = participants(src, dst)
    return [ranks] if len(ranks) > 1 else []


# ----- the assignment (pure) ------------------------------------------------------------------


def assign_shares(lengths: Sequence[Sequence[int]], num_replicas: int,
                  keys: Sequence[Sequence[Hashable]] | None = None,
                  ids: Sequence[Sequence[int]] | None = None) -> list[list[tuple[int, int]]]:
    """Sequences ``(holder, index)`` for each destination replica, balanced by tokens.

    ``lengths[h][i]``: tokens of holder h's sequence i. Sequences sharing a ``keys[h][i]`` value
    travel together. Units are placed largest first onto the replica with the fewest tokens (ties:
    fewest sequences, then lowest index), so replica loads differ by at most the largest unit.
    With ``ids`` (sample ids), ties between units break by their smallest sample id instead of
    their position, so the assignment depends only on the set of (sample id, length): batches of
    the same samples coming from different producers land on the same replicas.
    Each share is in global order (holder, index).
    """
    units: dict[Hashable, list[tuple[int, int]]] = {}
    for h, row in enumerate(lengths):
        for i in range(len(row)):
            units.setdefault(("key", keys[h][i]) if keys is not None else ("seq", h, i), []).append((h, i))
    members = list(units.values())
    tokens = [sum(lengths[h][i] for h, i in m) for m in members]
    order = [min(ids[h][i] for h, i in m) for m in members] if ids is not None else list(range(len(members)))
    load, count = [0] * num_replicas, [0] * num_replicas
    shares: list[list[tuple[int, int]]] = [[] for _ in range(num_replicas)]
    for u in sorted(range(len(members)), key=lambda u: (-tokens[u], order[u])):
        j = min(range(num_replicas), key=lambda j: (load[j], count[j], j))
        load[j] += tokens[u]
        count[j] += len(members[u])
        shares[j].extend(members[u])
    return [sorted(s) for s in shares]


# ----- headers and packed messages ------------------------------------------------------------


@dataclass(frozen=True)
class _Header:
    sample_ids: list[int]
    lengths: list[int]
    token_schema: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype, trailing shape)
    seq_schema: tuple[tuple[str, str, tuple[int, ...]], ...]
    meta: dict[str, list[Any]]
    keys: list[Hashable] | None


def _schema(fields: dict[str, torch.Tensor]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    return tuple((k, str(t.dtype).removeprefix("torch."), tuple(t.shape[1:])) for k, t in sorted(fields.items()))


def _header(batch: SequenceBatch, keep_together: str | None) -> _Header:
    keys = None
    if keep_together is not None:
        if keep_together in batch.seq_fields:
            values = batch.seq_fields[keep_together]
            if values.dim() != 1:
                raise ValueError(f"keep_together field {keep_together!r} must be one value per sequence, "
                                 f"got shape {list(values.shape)}")
            keys = values.tolist()
        elif keep_together in batch.meta:
            keys = list(batch.meta[keep_together])
        else:
            raise ValueError(f"keep_together field {keep_together!r} is not a sequence or meta field of the batch")
    return _Header(batch.sample_ids.tolist(), batch.lengths.tolist(), _schema(batch.token_fields),
                   _schema(batch.seq_fields), {k: list(v) for k, v in batch.meta.items()}, keys)


def _check_headers(headers: list[_Header], holders: tuple[int, ...]) -> None:
    first = headers[0]
    for h, header in zip(holders, headers):
        for what, mine, theirs in (("token fields", header.token_schema, first.token_schema),
                                   ("sequence fields", header.seq_schema, first.seq_schema),
                                   ("meta fields", sorted(header.meta), sorted(first.meta))):
            if mine != theirs:
                raise ValueError(f"holder rank {h} has {what} {list(mine)}, but holder rank {holders[0]} "
                                 f"has {list(theirs)}; every replica must produce the same fields")
    ids = [i for header in headers for i in header.sample_ids]
    if len(set(ids)) != len(ids):
        raise ValueError("sample ids are not unique across the source replicas")


def _fields_layout(header: _Header, num_tokens: int, num_seqs: int):
    """(kind, name, dtype, shape, byte offset, bytes) of each field in a packed message, and its size."""
    out, offset = [], 0
    for kind, schema, rows in (("token", header.token_schema, num_tokens), ("seq", header.seq_schema, num_seqs)):
        for name, dtype_name, trailing in schema:
            dtype = getattr(torch, dtype_name)
            shape = (rows, *trailing)
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            out.append((kind, name, dtype, shape, offset, nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
    return out, offset


def _pack(batch: SequenceBatch, header: _Header, device: torch.device) -> torch.Tensor:
    fields, size = _fields_layout(header, batch.num_tokens, len(batch))
    buf = torch.empty(size, dtype=torch.uint8, device=device)  # [bytes]
    for kind, name, dtype, shape, offset, nbytes in fields:
        source = batch.token_fields[name] if kind == "token" else batch.seq_fields[name]
        buf[offset:offset + nbytes].view(dtype).view(shape).copy_(source)
    return buf


def _unpack(buf: torch.Tensor, header: _Header, index: list[int]) -> SequenceBatch:
    lengths = [header.lengths[i] for i in index]
    fields, _ = _fields_layout(header, sum(lengths), len(index))
    token_fields, seq_fields = {}, {}
    for kind, name, dtype, shape, offset, nbytes in fields:
        (token_fields if kind == "token" else seq_fields)[name] = buf[offset:offset + nbytes].view(dtype).view(shape)
    return SequenceBatch(torch.tensor([header.sample_ids[i] for i in index], dtype=torch.long),
                         torch.tensor(lengths, dtype=torch.long), token_fields, seq_fields,
                         {k: [v[i] for i in index] for k, v in header.meta.items()})


def _local_piece(batch: SequenceBatch, index: list[int], device: torch.device) -> SequenceBatch:
    piece = batch.select(index)
    return SequenceBatch(piece.sample_ids, piece.lengths,
                         {k: v.to(device) for k, v in piece.token_fields.items()},
                         {k: v.to(device) for k, v in piece.seq_fields.items()}, piece.meta)


# ----- the redistribution ---------------------------------------------------------------------


def redistribute(world, batch: SequenceBatch | None, src: Layout, dst: Layout, *,
                 keep_together: str | None = None) -> SequenceBatch | None:
    """Move the holders' batches of ``src`` to the DP replicas of ``dst``; every rank calls this.

    ``batch``: the replica's outputs on its holder (ignored on other ranks). Returns this rank's
    replica's share (on ``world.device``) on ranks of ``dst``, None elsewhere. ``keep_together``:
    a sequence or meta field whose equal values must land on one replica (e.g. GRPO groups).
    """
    for name, layout in (("source", src), ("destination", dst)):
        if not isinstance(layout, Layout):
            raise ValueError(f"{name} layout must be a Layout, got {layout!r}")
        if max(layout.ranks) >= world.size:
            raise ValueError(f"{name} layout {layout} names rank {max(layout.ranks)}, "
                             f"but the job has {world.size} ranks")
    holders, ranks, me = source_holders(src), participants(src, dst), world.rank
    if me not in ranks:
        return None
    mine = _header(batch, keep_together) if me in holders and isinstance(batch, SequenceBatch) else None
    if me in holders and mine is None:
        raise ValueError(f"rank {me} holds the outputs of replica {src.coord(me).dp} of {src} "
                         f"but was given {type(batch).__name__}, not a SequenceBatch")

    # Step 1: every participant learns every holder's header.
    group = world.groups.get(ranks)
    gathered: list[_Header | None] = [mine]
    if group is not None:
        gathered = [None] * len(ranks)
        dist.all_gather_object(gathered, mine, group=group)
    headers = [gathered[ranks.index(h)] for h in holders]
    _check_headers(headers, holders)

    # Step 2: the same assignment on every rank.
    keys = [h.keys for h in headers] if keep_together is not None else None
    shares = assign_shares([h.lengths for h in headers], dst.dp, keys, [h.sample_ids for h in headers])

    # Step 3: holders send each consumer rank its replica's part; consumers receive from every holder.
    sends, recvs, pieces = [], [], {}
    if me in holders:
        h = holders.index(me)
        for j in range(dst.dp):
            index = [i for hh, i in shares[j] if hh == h]
            targets = [r for r in dst.replica_ranks(j) if r != me]
            if index and targets:
                payload = _pack(batch.select(index), headers[h], world.device)
                sends += [(payload, r) for r in targets]
    if me in dst:
        j = dst.coord(me).dp
        for h, holder in enumerate(holders):
            index = [i for hh, i in shares[j] if hh == h]
            if not index:
                continue
            if holder == me:
                pieces[h] = _local_piece(batch, index, world.device)
                continue
            lengths = sum(headers[h].lengths[i] for i in index)
            _, size = _fields_layout(headers[h], lengths, len(index))
            buf = torch.empty(size, dtype=torch.uint8, device=world.device)
            recvs.append((buf, holder))
            pieces[h] = (buf, index)
    for w in comm.batch_isend_irecv(sends, recvs):
        w.wait()
    if me not in dst:
        return None
    parts = [p if isinstance(p, SequenceBatch) else _unpack(p[0], headers[h], p[1]) for h, p in sorted(pieces.items())]
    return SequenceBatch.concat(parts) if parts else _unpack(
        torch.empty(0, dtype=torch.uint8, device=world.device), headers[0], [])
