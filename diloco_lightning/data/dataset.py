"""Per-node training stream and shared held-out set over a flat token file.

Layout of a token file of N tokens, with W = seq_len + 1 (inputs plus shifted targets)::

    [ train region: blocks of W tokens ............ | held-out: last val_fraction ]
      block b = tokens[b*W : (b+1)*W]

Node ``r`` of ``n`` owns blocks ``r, r+n, r+2n, ...`` (interleaved, so every node samples
the whole corpus and shards are disjoint by construction); each node gets the same count
``S = n_blocks // n``. Its stream visits its S blocks once per epoch in an order drawn
from ``numpy.random.default_rng([seed, r, epoch])``, so sample ``k`` of the stream is a
pure function of (seed, r, n, k): resuming only needs ``k`` (the ``position``).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from diloco_lightning.data.tokens import check_token_dtype, open_tokens

log = logging.getLogger(__name__)

__all__ = ["held_out_start", "ShardedTokenDataset", "HeldOutDataset"]


def held_out_start(n_tokens: int, seq_len: int, val_fraction: float) -> int:
    """Index of the first held-out token: the last ``ceil(val_fraction * n)`` tokens, at least one window."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    n_val = max(math.ceil(n_tokens * val_fraction), seq_len + 1)
    if n_tokens - n_val < seq_len + 1:
        raise ValueError(
            f"seq_len: {n_tokens} tokens are too few for a training window and a held-out window of "
            f"seq_len+1={seq_len + 1} tokens (val_fraction={val_fraction})"
        )
    return n_tokens - n_val


class _TokenFileMixin:
    """Opens the memmap lazily so datasets pickle cheaply into DataLoader worker processes."""

    path: Path
    dtype: np.dtype
    seq_len: int
    _tokens: np.memmap | None

    def _data(self) -> np.memmap:
        if self._tokens is None:
            self._tokens = open_tokens(self.path, self.dtype)
        return self._tokens

    def _window(self, start: int) -> torch.Tensor:
        w = self._data()[start : start + self.seq_len + 1]
        return torch.from_numpy(w.astype(np.int64))  # (seq_len + 1,)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_tokens"] = None  # a memmap would pickle as a full in-memory copy
        return state


class ShardedTokenDataset(_TokenFileMixin, IterableDataset):
    """Infinite stream of ``(seq_len + 1,)`` int64 windows from this node's shard of ``[0, end)``.

    Args:
        path, token_dtype: the flat token file and its dtype (``"uint16"``/``"uint32"``).
        seq_len: tokens per training example (windows hold ``seq_len + 1``).
        node_rank, num_nodes: which shard (``0 <= node_rank < num_nodes``).
        seed: shuffling seed (same on all nodes is fine: each node also mixes in its rank).
        end: tokens at or past ``end`` are never read (the held-out split); default: all.
        batch_size: the DataLoader's batch size; only used to split work between
            DataLoader worker processes by whole batches, so ``num_workers > 0`` yields
            exactly the same batches in the same order as ``num_workers=0``.

    ``state_dict()`` holds ``position``: samples yielded so far (counted in this process,
    so exact with ``num_workers=0``); a new ``iter()`` starts from it.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        token_dtype: str,
        *,
        seq_len: int,
        node_rank: int = 0,
        num_nodes: int = 1,
        seed: int = 0,
        end: int | None = None,
        batch_size: int = 1,
    ) -> None:
        super().__init__()
        check_int("seq_len", seq_len, 1)
        check_int("num_nodes", num_nodes, 1)
        check_int("node_rank", node_rank, 0)
        check_int("seed", seed, 0)
        check_int("batch_size", batch_size, 1)
        if node_rank >= num_nodes:
            raise ValueError(f"node_rank must be < num_nodes={num_nodes}, got {node_rank}")
        self.path, self.dtype = Path(path), check_token_dtype(token_dtype)
        self.seq_len, self.node_rank, self.num_nodes, self.seed = seq_len, node_rank, num_nodes, seed
        self.batch_size = batch_size
        self._tokens = None
        n_tokens = len(self._data())
        self.end = n_tokens if end is None else end
        if not 0 < self.end <= n_tokens:
            raise ValueError(f"end must be in (0, {n_tokens}], got {end!r}")
        self.n_blocks = self.end // (seq_len + 1)
        self.shard_size = self.n_blocks // num_nodes  # S: samples per node per epoch
        if self.shard_size == 0:
            raise ValueError(
                f"num_nodes: {self.end} training tokens hold {self.n_blocks} windows of seq_len+1={seq_len + 1}, "
                f"fewer than num_nodes={num_nodes}; use more data, a smaller seq_len or fewer nodes"
            )
        self.position = 0
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    # -- deterministic addressing ------------------------------------------------------

    def block_index(self, position: int) -> int:
        """Global block index of stream sample ``position``."""
        epoch, j = divmod(position, self.shard_size)
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, self.node_rank, epoch])
            perm = np.arange(self.shard_size, dtype=np.int64 if self.shard_size >= 2**32 else np.uint32)
            rng.shuffle(perm)
            self._perm_epoch, self._perm = epoch, perm
        k = int(self._perm[j])  # k-th block of this shard
        return self.node_rank + k * self.num_nodes

    def sample(self, position: int) -> torch.Tensor:
        """The window at stream ``position`` (does not move the stream)."""
        return self._window(self.block_index(position) * (self.seq_len + 1))

    # -- iteration and state -----------------------------------------------------------

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        if info is None or info.num_workers == 1:
            while True:
                pos = self.position
                self.position += 1
                yield self.sample(pos)
        # Worker w of W produces global batches w, w+W, ... (the DataLoader interleaves
        # batches round-robin), keeping the sample order identical to num_workers=0.
        start, b = self.position, info.id
        while True:
            first = start + b * self.batch_size
            for pos in range(first, first + self.batch_size):
                yield self.sample(pos)
            b += info.num_workers

    def state_dict(self) -> dict[str, Any]:
        return stream_state(self, self.position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _warn_mismatch(self, state)
        check_int("position", state["position"], 0)
        self.position = int(state["position"])


class HeldOutDataset(_TokenFileMixin, Dataset):
    """Consecutive ``(seq_len + 1,)`` windows of tokens ``[start, end)``; the same on every node.
    ``limit``: at most this many windows (the first ones), so that a held-out set is a number of
    windows, independent of any batch size."""

    def __init__(
        self, path: str | os.PathLike, token_dtype: str, *, seq_len: int, start: int, end: int | None = None,
        limit: int | None = None,
    ) -> None:
        check_int("seq_len", seq_len, 1)
        self.path, self.dtype, self.seq_len = Path(path), check_token_dtype(token_dtype), seq_len
        self._tokens = None
        n_tokens = len(self._data())
        self.start, self.end = start, n_tokens if end is None else end
        if not 0 <= self.start < self.end <= n_tokens:
            raise ValueError(f"start/end: need 0 <= start < end <= {n_tokens}, got {start}, {end}")
        self.n = (self.end - self.start) // (seq_len + 1)
        if self.n == 0:
            raise ValueError(f"seq_len: {self.end - self.start} held-out tokens hold no window of {seq_len + 1}")
        if limit is not None:
            check_int("limit", limit, 1)
            if limit > self.n:
                log.warning("held-out set: %d windows asked for, the split holds %d: scoring all of them", limit, self.n)
            self.n = min(self.n, limit)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self._window(self.start + i * (self.seq_len + 1))


def check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


#: what fixes a node's sample stream besides its position (a data state saved with others warns on load)
STREAM_KEYS = ("seed", "node_rank", "num_nodes", "seq_len")


def stream_state(src: Any, position: int) -> dict[str, Any]:
    """A data ``state_dict`` (the dataset's and the datamodule's): ``position``, then ``src``'s stream keys."""
    return {"position": position, **{key: getattr(src, key) for key in STREAM_KEYS}}


def _warn_mismatch(ds: ShardedTokenDataset, state: dict[str, Any]) -> None:
    for key in STREAM_KEYS:
        if key in state and state[key] != getattr(ds, key):
            log.warning(
                "data state was saved with %s=%r but this run uses %r; continuing at position %d of the new stream",
                key, state[key], getattr(ds, key), state["position"],
            )
