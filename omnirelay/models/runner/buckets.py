"""Shapes of the static runner: buckets, and how a step's rows become launches (pure).

A CUDA graph replays fixed shapes, so every launch is padded up to a bucket:

* **decode** — ``B`` rows of one token each: ``B`` from :attr:`Buckets.batch_sizes`
  (1, 2, 4 … 64), attention over the first ``L`` cached positions of each row's slot with
  ``L`` from :attr:`Buckets.lengths` (256, 1024, 4096 … up to ``max_model_len``).
* **prefill** — ``B`` rows of up to ``T`` tokens each: ``T`` from
  :attr:`Buckets.prefill_tokens` (16, 64, 256, 1024), ``B·T ≤ max_prefill_tokens``. A
  *fresh* piece (starting at position 0) attends only to itself (causal), so it needs no
  ``L``; a piece that continues cached positions (a prompt longer than the largest ``T``,
  a chunked prefill) gathers ``L`` cached positions like a decode.

:func:`plan_prefill` and :func:`plan_decode` turn a step's rows into :class:`Launch`es:
which rows share a launch, in which order, padded to which shape. Rows are never
reordered inside a row's own pieces: piece ``k`` of a row runs in a launch after the one
holding piece ``k − 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from omnirelay.errors import ConfigError, ModelError

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "DEFAULT_MAX_PREFILL_TOKENS",
    "DEFAULT_PREFILL_TOKENS",
    "Buckets",
    "Launch",
    "Piece",
    "bucket",
    "length_buckets",
    "plan_decode",
    "plan_prefill",
]

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_PREFILL_TOKENS = (16, 64, 256, 1024)
#: Most padded tokens (B·T) of one prefill launch.
DEFAULT_MAX_PREFILL_TOKENS = 8192
#: The smallest attention length bucket; each next one is 4x as long.
_FIRST_LENGTH = 256


def bucket(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest size ``>= n`` (None when ``n`` exceeds them all)."""
    for size in sizes:
        if size >= n:
            return size
    return None


def length_buckets(max_model_len: int) -> tuple[int, ...]:
    """256, 1024, 4096 … below ``max_model_len``, then ``max_model_len`` itself."""
    out = []
    length = _FIRST_LENGTH
    while length < max_model_len:
        out.append(length)
        length *= 4
    out.append(max_model_len)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Buckets:
    """The shapes one runner captures (and pads every launch to)."""

    max_num_seqs: int
    max_model_len: int
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    prefill_tokens: tuple[int, ...] = DEFAULT_PREFILL_TOKENS
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    lengths: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_model_len < 1:
            raise ConfigError("max_num_seqs and max_model_len must be >= 1")
        for name in ("batch_sizes", "prefill_tokens"):
            sizes = getattr(self, name)
            if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
                raise ConfigError(f"{name} must be increasing positive sizes, got {sizes}")
        # Batches never need to exceed the slots; the largest bucket covers them all.
        sizes = tuple(b for b in self.batch_sizes if b < self.max_num_seqs)
        top = bucket(self.max_num_seqs, self.batch_sizes) or self.max_num_seqs
        object.__setattr__(self, "batch_sizes", (*sizes, min(top, self.max_num_seqs)))
        tokens = tuple(t for t in self.prefill_tokens if t < self.max_model_len)
        object.__setattr__(self, "prefill_tokens", tokens or (self.max_model_len,))
        if self.max_prefill_tokens < self.prefill_tokens[0]:
            raise ConfigError(
                f"max_prefill_tokens {self.max_prefill_tokens} is below the smallest prefill bucket "
                f"{self.prefill_tokens[0]}"
            )
        if not self.lengths:
            object.__setattr__(self, "lengths", length_buckets(self.max_model_len))

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    @property
    def max_piece(self) -> int:
        return self.prefill_tokens[-1]

    def batch(self, n: int) -> int:
        size = bucket(n, self.batch_sizes)
        assert size is not None, (n, self.batch_sizes)
        return size

    def length(self, n: int) -> int:
        size = bucket(n, self.lengths)
        if size is None:
            raise ModelError(f"{n} positions exceed max_model_len {self.max_model_len}")
        return size

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (B, T) prefill bucket within ``max_prefill_tokens``."""
        return [
            (b, t)
            for t in self.prefill_tokens
            for b in self.batch_sizes
            if b * t <= self.max_prefill_tokens or b == 1
        ]

    def decode_shapes(self) -> list[tuple[int, int]]:
        """Every (B, L) decode bucket."""
        return [(b, n) for n in self.lengths for b in self.batch_sizes]

    def fits(self, b: int, t: int) -> bool:
        return b * t <= self.max_prefill_tokens or b == 1


@dataclass(frozen=True, slots=True)
class Piece:
    """``count`` tokens of row ``row``: the row's tokens ``[offset, offset + count)``, at
    positions ``[start, start + count)``. ``is_last``: the row's last piece (it samples)."""

    row: int
    start: int
    offset: int
    count: int
    is_last: bool


@dataclass(frozen=True, slots=True)
class Launch:
    """One padded forward pass: ``pieces`` in rows ``0..len(pieces)-1`` of a ``batch`` x
    ``tokens`` block; ``attn_len`` None: each piece attends to itself only (fresh)."""

    batch: int
    tokens: int
    attn_len: int | None
    pieces: tuple[Piece, ...]
    #: the launch row of each piece: its row's KV slot (a decode that reads the cache in
    #: place, see :func:`plan_decode`); None: piece ``i`` in row ``i``
    rows_at: tuple[int, ...] | None = None

    @property
    def is_fresh(self) -> bool:
        return self.attn_len is None

    @property
    def in_place(self) -> bool:
        """Each piece sits in the launch row of its own slot."""
        return self.rows_at is not None

    def row_of(self, i: int) -> int:
        """The launch row of piece ``i``."""
        return i if self.rows_at is None else self.rows_at[i]


def _split(row: int, start: int, count: int, piece: int) -> list[Piece]:
    out = []
    offset = 0
    while offset < count:
        n = min(piece, count - offset)
        out.append(Piece(row, start + offset, offset, n, is_last=offset + n == count))
        offset += n
    return out


def _pack(pieces: list[Piece], buckets: Buckets, *, fresh: bool) -> list[Launch]:
    """Greedy packing, longest first, into launches within the token budget."""
    launches: list[Launch] = []
    group: list[Piece] = []

    def close() -> None:
        if group:
            t = bucket(max(p.count for p in group), buckets.prefill_tokens)
            assert t is not None
            attn = None if fresh else buckets.length(max(p.start + p.count for p in group))
            launches.append(Launch(buckets.batch(len(group)), t, attn, tuple(group)))
            group.clear()

    for p in sorted(pieces, key=lambda p: -p.count):
        if group:
            t = bucket(max(p.count, group[0].count), buckets.prefill_tokens)
            assert t is not None
            b = bucket(len(group) + 1, buckets.batch_sizes)
            if b is None or not buckets.fits(b, t):
                close()
        group.append(p)
    close()
    return launches


def plan_prefill(rows: Sequence[tuple[int, int]], buckets: Buckets) -> list[Launch]:
    """Launches for prefill rows ``(start, count)`` (row index = position in ``rows``).

    Each row is cut into pieces of at most the largest prefill bucket. The first piece
    of a fresh row (start 0) runs in a fresh launch; every other piece in rounds after
    it (round ``k`` holds piece ``k`` of every row that has one)."""
    rounds: list[list[Piece]] = []
    fresh: list[Piece] = []
    for row, (start, count) in enumerate(rows):
        if count < 1:
            raise ModelError(f"prefill row {row} has no tokens")
        if start + count > buckets.max_model_len:
            raise ModelError(
                f"a request needs {start + count} positions, more than max_model_len {buckets.max_model_len}"
            )
        pieces = _split(row, start, count, buckets.max_piece)
        if start == 0:
            fresh.append(pieces.pop(0))
        for k, piece in enumerate(pieces):
            if len(rounds) <= k:
                rounds.append([])
            rounds[k].append(piece)
    launches = _pack(fresh, buckets, fresh=True)
    for pieces in rounds:
        launches += _pack(pieces, buckets, fresh=False)
    return launches


def plan_decode(
    positions: Sequence[int], buckets: Buckets, slots: Sequence[int] | None = None
) -> list[Launch]:
    """Launches for decode rows (one token each at ``positions[row]``), in row order.

    With the rows' KV ``slots``: when the rows fit one launch whose batch bucket covers
    their highest slot, each row goes to the launch row of its slot (``rows_at``; the
    other rows pad) and attention reads the cache in place. The slot table keeps its
    holders packed from 0, so a decode of every holder always does."""
    if slots is not None and positions and len(set(slots)) == len(slots) == len(positions):
        size = bucket(len(positions), buckets.batch_sizes)
        if size is not None and max(slots) < size and min(slots) >= 0:
            (launch,) = plan_decode(positions, buckets)
            return [Launch(size, 1, launch.attn_len, launch.pieces, tuple(slots))]
    launches = []
    for first in range(0, len(positions), buckets.max_batch):
        rows = range(first, min(first + buckets.max_batch, len(positions)))
        pieces = []
        for row in rows:
            if positions[row] + 1 > buckets.max_model_len:
                raise ModelError(
                    f"a request reached max_model_len {buckets.max_model_len}; raise executor_args.max_model_len"
                )
            pieces.append(Piece(row, positions[row], 0, 1, is_last=True))
        attn = buckets.length(max(p.start for p in pieces) + 1)
        launches.append(Launch(buckets.batch(len(pieces)), 1, attn, tuple(pieces)))
    return launches
