"""One owned byte buffer that successive delta reads reuse (issue 42: the master round's speed).

Reading a delta into fresh tensors costs a page fault per 4 KiB of it, every time: on the
benchmark's 25M-parameter FP32 delta (101 MB) that is about three times the copy itself. A
:class:`ReadArena` keeps one buffer, owned memory of this process (never a map of the file: a
hub writer that truncates a mapped file kills its reader with SIGBUS), and each read lands in
it, so a round over N deltas faults in one delta's pages once, not N times.

The buffer grows to the largest read it is asked for, which the reader bounds first (a file
over the honest size of a delta of this model is refused before it is read). Tensors read into
it are views: they are valid until the next read into the same arena, so a caller reads one
delta, folds it into what it keeps (the round's sum), then reads the next.
"""

from __future__ import annotations

import torch

__all__ = ["ReadArena"]


class ReadArena:
    """A reusable byte buffer (see the module docstring)."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """The bytes the arena holds now (0 before its first read or after :meth:`release`)."""
        return 0 if self._buf is None else self._buf.numel()

    def take(self, nbytes: int) -> torch.Tensor:
        """A 1-D ``uint8`` tensor of ``nbytes`` bytes over the arena's buffer (grown if too small);
        whatever an earlier :meth:`take` returned now shares these bytes."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = None  # the old buffer goes before the new one comes: one buffer at a time
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._buf[:nbytes]

    def release(self) -> None:
        """Give the memory back (the next :meth:`take` allocates again)."""
        self._buf = None
