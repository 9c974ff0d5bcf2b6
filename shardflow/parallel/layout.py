"""A parallel layout: which ranks run a model, split as (pp, dp, tp).

Rank order inside a layout is pp outermost, then dp, then tp innermost, so that the ranks of
one tensor-parallel group are neighbours (neighbouring GPUs share the fastest links):

    index in layout.ranks = pp_index * dp * tp + dp_index * tp + tp_index

A layout is a value: hashable, comparable and printable as ``d2p1t4@0-7``.

The ranks of each tensor-parallel group must increase (so that a collective's rank order is the
tp order), but replicas and stages may be interleaved: ``d2p1t2@0,2,1,3`` has tp groups (0, 2)
and (1, 3). Adaptive tensor parallelism uses such layouts: merging its two replicas gives
``d1p1t4@0-3`` with every rank keeping a sub-slice of the weights it already holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator

_LAYOUT_RE = re.compile(r"^d(\d+)p(\d+)t(\d+)@([0-9,\-]+)$")


@dataclass(frozen=True)
class Coord:
    """Position of one rank inside a layout."""

    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    """Distinct global ranks split into pp stages x dp replicas x tp shards (tp groups increasing)."""

    ranks: tuple[int, ...]
    pp: int = 1
    dp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        # A range (as from ``contiguous``) is increasing by construction: skip the per-rank checks,
        # which cost milliseconds for the thousand-rank layouts the planner builds by the thousand.
        given = self.ranks
        simple = isinstance(given, range) and given.step == 1 and given.start >= 0
        object.__setattr__(self, "ranks", tuple(given) if simple else tuple(int(r) for r in given))
        for axis in ("pp", "dp", "tp"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"layout {axis} must be a positive integer, got {value!r}")
        if len(self.ranks) != self.pp * self.dp * self.tp:
            raise ValueError(
                f"layout needs pp*dp*tp = {self.pp}*{self.dp}*{self.tp} = "
                f"{self.pp * self.dp * self.tp} ranks, got {len(self.ranks)}: {list(self.ranks)}"
            )
        if simple:
            return
        if any(r < 0 for r in self.ranks):
            raise ValueError(f"layout ranks must be non-negative, got {list(self.ranks)}")
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"layout ranks must be distinct, got {list(self.ranks)}")
        for start in range(0, len(self.ranks), self.tp):
            group = self.ranks[start : start + self.tp]
            if any(b <= a for a, b in zip(group, group[1:])):
                raise ValueError(f"layout {list(self.ranks)}: the ranks of each tp group must increase, "
                                 f"got {list(group)}")

    def __hash__(self) -> int:
        # Layouts key many caches and may list a thousand ranks: hash them once.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.ranks, self.pp, self.dp, self.tp))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        # string hashes differ between processes: never ship the cached one
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    # ----- construction and printing -------------------------------------------------------

    @classmethod
    def contiguous(cls, start: int = 0, *, pp: int = 1, dp: int = 1, tp: int = 1) -> "Layout":
        return cls(range(start, start + pp * dp * tp), pp=pp, dp=dp, tp=tp)

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """Parse ``d2p1t4@0-7`` or ``d1p1t2@0,2``."""
        match = _LAYOUT_RE.match(text.strip())
        if not match:
            raise ValueError(f"cannot parse layout {text!r}; expected e.g. 'd2p1t4@0-7'")
        dp, pp, tp = (int(g) for g in match.groups()[:3])
        return cls(parse_ranks(match.group(4)), pp=pp, dp=dp, tp=tp)

    def __str__(self) -> str:
        return f"d{self.dp}p{self.pp}t{self.tp}@{format_ranks(self.ranks)}"

    @property
    def shape(self) -> str:
        """The layout without its ranks, e.g. ``d2p1t4``."""
        return f"d{self.dp}p{self.pp}t{self.tp}"

    @property
    def size(self) -> int:
        return len(self.ranks)

    # ----- coordinates ---------------------------------------------------------------------

    @cached_property
    def _index(self) -> dict[int, int]:
        return {r: i for i, r in enumerate(self.ranks)}

    def __contains__(self, rank: object) -> bool:
        return rank in self._index

    def coord(self, rank: int) -> Coord:
        try:
            i = self._index[rank]
        except KeyError:
            raise ValueError(f"rank {rank} is not in layout {self}") from None
        pp, rest = divmod(i, self.dp * self.tp)
        dp, tp = divmod(rest, self.tp)
        return Coord(pp=pp, dp=dp, tp=tp)

    def rank_at(self, pp: int, dp: int, tp: int) -> int:
        return self.ranks[(pp * self.dp + dp) * self.tp + tp]

    def coords(self) -> Iterator[tuple[int, Coord]]:
        for r in self.ranks:
            yield r, self.coord(r)

    # ----- groups (each a tuple of global ranks, increasing) -------------------------------

    def tp_group(self, rank: int) -> tuple[int, ...]:
        c = self.coord(rank)
        return tuple(self.rank_at(c.pp, c.dp, t) for t in range(self.tp))

    def dp_group(self, rank: int) -> tuple[int, ...]:
        c = self.coord(rank)
        return tuple(self.rank_at(c.pp, d, c.tp) for d in range(self.dp))

    def pp_group(self, rank: int) -> tuple[int, ...]:
        c = self.coord(rank)
        return tuple(self.rank_at(p, c.dp, c.tp) for p in range(self.pp))

    def replica_ranks(self, dp: int) -> tuple[int, ...]:
        """All ranks (every stage and tp shard) of one data-parallel replica."""
        return tuple(self.rank_at(p, dp, t) for p in range(self.pp) for t in range(self.tp))

    def stage_ranks(self, pp: int) -> tuple[int, ...]:
        return tuple(self.rank_at(pp, d, t) for d in range(self.dp) for t in range(self.tp))

    def groups(self) -> list[tuple[int, ...]]:
        """Every multi-rank communication group this layout uses, in a fixed order."""
        found: set[tuple[int, ...]] = set()
        for r in self.ranks:
            for g in (self.tp_group(r), self.dp_group(r), self.pp_group(r)):
                if len(g) > 1:
                    found.add(g)
        if self.size > 1:
            found.add(self.ranks)
        return sorted(found, key=lambda g: (len(g), g))


def parse_ranks(text: str) -> tuple[int, ...]:
    """``"0-3,6,8-9"`` -> (0, 1, 2, 3, 6, 8, 9)."""
    ranks: list[int] = []
    for part in text.split(","):
        if not part:
            raise ValueError(f"empty item in rank list {text!r}")
        if "-" in part:
            lo, hi = part.split("-", 1)
            if int(hi) < int(lo):
                raise ValueError(f"rank range {part!r} runs backwards")
            ranks.extend(range(int(lo), int(hi) + 1))
        else:
            ranks.append(int(part))
    return tuple(ranks)


def format_ranks(ranks: tuple[int, ...]) -> str:
    """(0, 1, 2, 3, 6, 8, 9) -> ``"0-3,6,8-9"``."""
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(parts)


def merge_replicas(layout: Layout, factor: int) -> Layout:
    """Merge each run of ``factor`` consecutive DP replicas into one tp group ``factor`` times wider.

    Old tp index t of the m-th merged replica becomes new tp index ``t * factor + m``, so every rank
    holds a sub-slice of what it held before (heads, columns and vocabulary rows nest). Raises
    ValueError when the merged tp groups would not be increasing: start from ``split_replicas``.
    """
    if layout.pp != 1 or factor < 1 or layout.dp % factor:
        raise ValueError(f"cannot merge replicas of {layout} by {factor}: needs pp=1 and a factor dividing dp")
    tp = layout.tp * factor
    ranks = tuple(layout.rank_at(0, g * factor + j % factor, j // factor)
                  for g in range(layout.dp // factor) for j in range(tp))
    return Layout(ranks, pp=1, dp=layout.dp // factor, tp=tp)


def split_replicas(layout: Layout, factor: int) -> Layout:
    """The inverse of ``merge_replicas``: the layout whose replicas merge into ``layout``."""
    if layout.pp != 1 or factor < 1 or layout.tp % factor:
        raise ValueError(f"cannot split {layout} by {factor}: needs pp=1 and a factor dividing tp")
    tp = layout.tp // factor
    ranks = tuple(layout.rank_at(0, r // factor, t * factor + r % factor)
                  for r in range(layout.dp * factor) for t in range(tp))
    return Layout(ranks, pp=1, dp=layout.dp * factor, tp=tp)
