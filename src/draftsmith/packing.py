"""First-fit packing of samples into rows of a token budget: the hidden stage's extraction rows
and the train stage's training rows."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def first_fit(order: Iterable[int], lengths: Sequence[int] | Mapping[int, int],
              capacity: int) -> list[list[int]]:
    """Sample indices, taken in `order`, into rows of at most `capacity` tokens: each goes to
    the first of the last 64 open rows with room (so packing stays O(samples)), else opens a
    row; a sample longer than `capacity` gets a row of its own."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        r = next((r for r in range(max(0, len(rows) - 64), len(rows)) if room[r] >= n), None)
        if r is None:
            rows.append([])
            room.append(max(capacity, n))
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= n
    return rows
