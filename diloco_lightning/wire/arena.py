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

The arena may instead hold one tensor per key (:meth:`adopt`: the master gives it the memory of
the round's mean once the outer step has used it); a delta whose every tensor has the size of its
key's tensor is then read into those, and :meth:`give` hands them on (the master steps on them:
its next state). So the master's four state-sized buffers rotate, state -> sum -> read buffer ->
state, and a round faults in no new memory at all.

``lanes`` (:class:`~diloco_lightning.util.lanes.Lanes`, None: one thread): the threads a read into
the arena runs on, each reading its own contiguous run of tensors with ``preadv`` and taking their
norms; the results are folded in the file's order, so the bits are those of one thread.
"""

from __future__ import annotations

import torch

from diloco_lightning.util.lanes import Lanes

__all__ = ["ReadArena"]


class ReadArena:
    """A reusable byte buffer (see the module docstring)."""

    def __init__(self, lanes: Lanes | None = None) -> None:
        #: the threads reads into this arena run on (None: the calling thread alone)
        self.lanes = lanes
        self._buf: torch.Tensor | None = None
        self._by_key: dict[str, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        """The bytes the arena holds now (0 before its first read or after :meth:`release`)."""
        if self._by_key is not None:
            return sum(t.numel() * t.element_size() for t in self._by_key.values())
        return 0 if self._buf is None else self._buf.numel()

    def adopt(self, tensors: dict[str, torch.Tensor]) -> None:
        """Hold these tensors (contiguous, owned by no one else from now on) as one buffer per key,
        instead of any buffer held so far."""
        if all(t.is_contiguous() for t in tensors.values()):
            self._buf, self._by_key = None, dict(tensors)

    def slots(self, sizes: dict[str, int]) -> dict[str, torch.Tensor] | None:
        """One ``uint8`` slot per name of ``sizes`` (its byte count) over the adopted per-key
        tensors, or None when they do not fit exactly (then the caller :meth:`take`s one buffer)."""
        held = self._by_key
        if held is None or any(n not in held or held[n].numel() * held[n].element_size() != b
                               for n, b in sizes.items()):
            return None
        return {n: held[n].reshape(-1).view(torch.uint8) for n in sizes}

    def give(self, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The adopted per-key tensors that have the shape and dtype of ``like``'s (handed on: the
        arena holds nothing after); {} when it holds none."""
        held, self._by_key, self._buf = self._by_key or {}, None, None
        return {k: t for k, t in held.items() if k in like and t.shape == like[k].shape and t.dtype == like[k].dtype}

    def take(self, nbytes: int) -> torch.Tensor:
        """A 1-D ``uint8`` tensor of ``nbytes`` bytes over the arena's buffer (grown if too small);
        whatever an earlier :meth:`take` returned now shares these bytes."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self._by_key = None  # one buffer at a time
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = None  # the old buffer goes before the new one comes
            self._buf = torch.empty(nbytes, dtype=torch.uint8)
        return self._buf[:nbytes]

    def release(self) -> None:
        """Give the memory back (the next :meth:`take` allocates again)."""
        self._buf, self._by_key = None, None
