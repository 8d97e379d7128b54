"""Fragments: which parameters sync together, on which schedule (Streaming DiLoCo).

Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512) splits the model into ``F``
fragments that sync on staggered schedules: fragment ``p`` sends its pseudo-gradient every
``H`` inner steps, offset by ``p * H / F``, so a worker uploads about ``1/F`` of the model every
``H/F`` steps instead of all of it every ``H``. This module is the one definition of the
split, shared by the worker (what a delta carries) and the master (what a delta may carry).

``fragments`` is given as

* an integer ``F``: the strided assignment of Streaming DiLoCo. A key whose dotted name holds
  an integer component (``model.layers.3.attn.q.weight``: the first such component, 3) belongs
  to a transformer block ``i`` and goes to fragment ``i mod F``. Every other synced key
  (embeddings, the final norm, the output head: no block index) that is *large* -- at least ``F``
  rows (first dimension) and more than ``1/(2F)`` of the model's synced values -- is split by
  rows (a tied embedding, 42 % of the tiny recipe's model and 68 % of a 25M-parameter Llama,
  would otherwise put a floor under the largest upload): once the blocks are placed, each large
  key in turn (state order) is cut into contiguous row ranges, one per fragment in fragment
  order, sized so that the fragments come out as even as whole rows allow (water-filling: the
  lightest fragments are filled first up to a common level; leftover rows to the largest
  remainders, ties to the lowest index). With blocks spread evenly that is ``n/F`` rows each,
  range ``p`` in fragment ``p``; a fragment already above the level gets no rows of that key.
  The remaining no-block keys are placed, largest first (ties by name), in the fragment holding
  the fewest values so far (ties: the lowest index).
* a list of pattern groups: fragment ``i`` is the ``i``-th entry, a pattern or a list of
  patterns. A pattern with ``*``, ``?`` or ``[`` is a shell glob on the key name (``fnmatch``);
  any other pattern names a key exactly or is a prefix of dotted names (``layers.1`` takes
  ``layers.1`` and ``layers.1.*``, not ``layers.10.*``). Every synced key must match exactly one
  group. Pattern groups place whole tensors: nothing is split.

*Pieces*: a fragment holds pieces, each a whole key (named as the key) or a row range of a split
key, named ``"<key>[<start>:<stop>]"`` (``tok_emb.weight[0:1024]``: rows 0 to 1023, Python's
slice notation). ``FragmentPlan.keys[name]`` lists a fragment's piece names; a fragment's delta
carries one tensor per piece, of the piece's shape; the manifest's ``keys_sha256`` is the digest
of the piece names, so a worker or master that splits the model otherwise is refused.
:meth:`FragmentPlan.substate` gives a fragment's pieces as views of a state (in-place updates of
a view write into the full tensor).

Fragments are named ``"0"``, ``"1"``, ... ``F = 1`` (or ``None``, or a one-group list) is no
fragmentation at all: :func:`build_plan` returns None and every file, header and manifest is
exactly the unfragmented format (no fragment entries at all). Integer buffers belong to no fragment (they never
travel in deltas; a worker installs them from the global at every install).

Schedule: a worker with ``F`` fragments reaches a *boundary* every ``H/F`` inner steps
(``inner_steps`` must be a multiple of ``F``); its ``r``-th boundary (``r = 1, 2, ...``) syncs
fragment ``r mod F`` (:meth:`FragmentPlan.fragment_at`), so fragment ``p`` syncs at inner
steps ``p*H/F + k*H``: Streaming DiLoCo's offsets, fragment 0's first sync at step ``H``.
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from diloco_lightning.util.errors import DiLoCoError

if TYPE_CHECKING:  # torch is imported where a plan meets tensors: checking the option needs none
    import torch

__all__ = ["FragmentPlan", "FragmentError", "HEADER_KEYS", "build_plan", "check_fragments_option", "fragment_count",
           "block_index", "keys_digest", "parse_fragment_header", "piece_name"]

#: the most fragments a run may have (a header's ``fragments`` above this is refused unread)
MAX_FRAGMENTS = 4096


class FragmentError(DiLoCoError, ValueError):
    """A ``fragments`` value that is malformed or does not fit the model."""


def check_fragments_option(value: Any) -> int | list[list[str]] | None:
    """``value`` normalised: None, an int ``F >= 1``, or a list of pattern lists; else :class:`FragmentError`."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise FragmentError(f"fragments must be an integer >= 1 or a list of parameter-name patterns, got {value!r}")
    if isinstance(value, int):
        if not 1 <= value <= MAX_FRAGMENTS:
            raise FragmentError(f"fragments must be an integer from 1 to {MAX_FRAGMENTS}, got {value!r}")
        return value
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        raise FragmentError(f"fragments must be an integer >= 1 or a non-empty list of parameter-name patterns, got {value!r}")
    if len(value) > MAX_FRAGMENTS:
        raise FragmentError(f"fragments lists {len(value)} groups, more than {MAX_FRAGMENTS}")
    groups: list[list[str]] = []
    for i, entry in enumerate(value):
        patterns = [entry] if isinstance(entry, str) else entry
        if isinstance(patterns, str) or not isinstance(patterns, Sequence) or not patterns:
            raise FragmentError(f"fragments[{i}] must be a pattern or a non-empty list of patterns, got {entry!r}")
        for p in patterns:
            if not isinstance(p, str) or not p:
                raise FragmentError(f"fragments[{i}] holds an invalid pattern {p!r}")
        groups.append([str(p) for p in patterns])
    return groups


def fragment_count(value: Any) -> int:
    """How many fragments ``value`` asks for (1: none)."""
    v = check_fragments_option(value)
    if v is None:
        return 1
    return v if isinstance(v, int) else len(v)


def block_index(key: str) -> int | None:
    """The transformer block a key belongs to: its first dotted component that is a decimal
    integer (``layers.3.attn.weight`` -> 3), or None (embeddings, final norm, head)."""
    for part in key.split("."):
        if part.isdigit() and part.isascii():
            return int(part)
    return None


def _matches(pattern: str, key: str) -> bool:
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(key, pattern)
    return key == pattern or key.startswith(pattern.rstrip(".") + ".")


def keys_digest(keys: Sequence[str]) -> str:
    """SHA-256 hex of the fragment's key names, sorted, one per line: what the manifest records
    so a worker can tell that it splits the model as the master does."""
    return hashlib.sha256("\n".join(sorted(keys)).encode("utf-8")).hexdigest()


def piece_name(key: str, start: int, stop: int) -> str:
    """The name of rows ``start`` to ``stop - 1`` of ``key``: ``"<key>[<start>:<stop>]"``."""
    return f"{key}[{start}:{stop}]"


@dataclass(frozen=True)
class FragmentPlan:
    """The fragments of one model: ``keys[name]`` (in the state's key order) for each name in ``names``.

    ``keys[name]`` are the fragment's piece names: a whole key, or a row range of a split key
    (``rows[piece] = (key, start, stop)``; the module docstring)."""

    names: tuple[str, ...]
    keys: Mapping[str, tuple[str, ...]]
    #: the row pieces: piece name -> (key, first row, row after the last); empty when nothing is split
    rows: Mapping[str, tuple[str, int, int]] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return len(self.names)

    @property
    def split(self) -> bool:
        """Whether a tensor is split by rows (else every piece is a whole key)."""
        return bool(self.rows)

    def fragment_of(self, piece: str) -> str:
        """The fragment holding ``piece`` (a whole key's name, or a row piece's)."""
        for name in self.names:
            if piece in self.keys[name]:
                return name
        raise KeyError(piece)

    def fragment_at(self, boundary: int) -> str:
        """The fragment a worker's ``boundary``-th boundary (1-based) syncs: ``boundary mod F``."""
        return self.names[boundary % self.count]

    def digest(self, name: str) -> str:
        return keys_digest(self.keys[name])

    def key_of(self, piece: str) -> str:
        """The state key a piece is (part of)."""
        r = self.rows.get(piece)
        return piece if r is None else r[0]

    def base_keys(self, name: str) -> tuple[str, ...]:
        """The state keys fragment ``name`` holds all or rows of (each once, in piece order)."""
        return tuple(dict.fromkeys(self.key_of(p) for p in self.keys[name]))

    def view(self, piece: str, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``state``'s tensor of ``piece``: the whole tensor, or a view of its rows."""
        r = self.rows.get(piece)
        if r is None:
            return state[piece]
        key, start, stop = r
        return state[key][start:stop]

    def numel(self, name: str, state: Mapping[str, torch.Tensor]) -> int:
        return sum(self.view(p, state).numel() for p in self.keys[name])

    def substate(self, name: str, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors of fragment ``name`` by piece name: the same tensor objects for whole keys,
        views of the rows for row pieces (no copy: an in-place update writes into ``state``)."""
        return {p: self.view(p, state) for p in self.keys[name]}

    def pieces(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every fragment's pieces by name, as :meth:`substate` gives them, in ``state``'s key order
        (a split key's pieces in row order): what the master's outer optimizer steps on when a
        tensor is split, so each piece has its own buffers, updated only with its fragment."""
        by_key: dict[str, list[str]] = {}
        for name in self.names:
            for p in self.keys[name]:
                by_key.setdefault(self.key_of(p), []).append(p)
        out: dict[str, torch.Tensor] = {}
        for k in state:
            for p in sorted(by_key.get(k, ()), key=lambda p: self.rows[p][1] if p in self.rows else 0):
                out[p] = self.view(p, state)
        return out

    def optimizer_fragments(self) -> dict[str, list[str]]:
        """``{name: [piece, ...]}``, as :class:`~diloco_lightning.outer.PACGAD` takes them (stepping
        on :meth:`pieces` when the plan splits a tensor)."""
        return {n: list(self.keys[n]) for n in self.names}


def _splits(keys: Sequence[str], state: Mapping[str, torch.Tensor], count: int) -> set[str]:
    """The no-block keys split by rows among ``count`` fragments: at least ``count`` rows and more
    than ``1/(2 count)`` of the synced values."""
    total = sum(state[k].numel() for k in keys)
    return {k for k in keys if block_index(k) is None and state[k].dim() >= 1 and state[k].shape[0] >= count
            and 2 * count * state[k].numel() > total}


def _row_shares(rows: int, per_row: int, sizes: Sequence[int]) -> list[int]:
    """How many of ``rows`` rows (``per_row`` values each) each fragment gets so that the fragments
    (``sizes`` values so far) come out as even as whole rows allow: water-filling, the lightest
    filled first up to a common level; the rows a level leaves over (fractions of a row) go to the
    largest remainders, ties to the lowest index."""
    total = rows * per_row
    order = sorted(sizes)
    level = 0.0
    for k in range(1, len(order) + 1):
        level = (total + sum(order[:k])) / k
        if k == len(order) or level <= order[k]:
            break
    want = [max(0.0, level - s) / per_row for s in sizes]
    out = [int(w) for w in want]
    for i in sorted(range(len(sizes)), key=lambda i: (-(want[i] - out[i]), i))[: rows - sum(out)]:
        out[i] += 1
    return out


def stepped_state(plan: FragmentPlan | None, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What an outer optimizer steps on in a run split by ``plan``: ``state`` itself, or, when a
    tensor is split by rows, every piece by name (views: a step writes into ``state``), so each row
    range has its own buffers (and PA-CGAD step counts), moved only by its fragment's deltas. The
    master and the simulator both step on this."""
    if plan is not None and plan.split:
        return plan.pieces(state)
    return state if isinstance(state, dict) else dict(state)


def split_optimizer_state(plan: FragmentPlan, saved: Mapping[str, Any]) -> dict[str, Any]:
    """An outer optimizer's ``state_dict`` of whole keys (``"<buffer>/<key>"`` or ``"<key>"``
    tensors, per-key ``keys`` lists), given per piece of ``plan``: a split key's buffers cut into its row ranges
    (exact: the buffers are elementwise) and its per-key counters repeated for each piece. What a
    master that splits rows needs to continue a run that had no fragments."""
    import torch

    pieces: dict[str, list[tuple[str, int, int]]] = {}
    for piece, (key, start, stop) in plan.rows.items():
        pieces.setdefault(key, []).append((piece, start, stop))
    for ranges in pieces.values():
        ranges.sort(key=lambda r: r[1])
    out: dict[str, Any] = {}
    for name, value in saved.items():
        family, sep, key = name.partition("/")
        if not sep:  # one buffer per key, named by the key alone (Nesterov's momentum)
            family, key = "", name
        # a buffer of another shape is passed on whole, for the optimizer's load to refuse by name
        if isinstance(value, torch.Tensor) and key in pieces and value.dim() >= 1 and value.shape[0] == pieces[key][-1][2]:
            for piece, start, stop in pieces[key]:
                out[f"{family}/{piece}" if family else piece] = value[start:stop].clone()
        else:
            out[name] = value
    keys = saved.get("keys")
    if isinstance(keys, list) and any(k in pieces for k in keys):
        order = [(i, p) for i, k in enumerate(keys) for p in ([r[0] for r in pieces[k]] if k in pieces else [k])]
        out["keys"] = [p for _, p in order]
        for name, value in saved.items():  # per-key counters: one list entry per key, in ``keys`` order
            if name != "keys" and isinstance(value, list) and len(value) == len(keys):
                out[name] = [value[i] for i, _ in order]
    return out


def build_plan(value: Any, state: Mapping[str, torch.Tensor]) -> FragmentPlan | None:
    """The :class:`FragmentPlan` of ``value`` for the model ``state`` (its floating and complex
    keys); None when ``value`` asks for one fragment (no fragmentation). :class:`FragmentError`
    when a key matches no group or several, or a fragment would be empty."""
    v = check_fragments_option(value)
    if v is None or v == 1 or (isinstance(v, list) and len(v) == 1):
        return None
    from diloco_lightning.wire.delta import synced_keys

    keys = synced_keys(state)
    names = [str(i) for i in range(v if isinstance(v, int) else len(v))]
    out: dict[str, list[str]] = {n: [] for n in names}
    rows: dict[str, tuple[str, int, int]] = {}
    if isinstance(v, int):
        sizes = [0] * v
        split = _splits(keys, state, v)
        rest = []
        for k in keys:
            b = block_index(k)
            if k in split:
                continue
            if b is None:
                rest.append(k)
            else:
                out[names[b % v]].append(k)
                sizes[b % v] += state[k].numel()
        for k in [k for k in keys if k in split]:  # after the blocks: their rows even the fragments out
            n, per_row = state[k].shape[0], state[k][:1].numel()
            start = 0
            for i, count in enumerate(_row_shares(n, per_row, sizes)):
                if not count:
                    continue
                piece = piece_name(k, start, start + count)
                if piece in state:
                    raise FragmentError(f"the model has a key {piece!r}, the name of a row range of {k!r}")
                rows[piece] = (k, start, start + count)
                out[names[i]].append(piece)
                sizes[i] += count * per_row
                start += count
        for k in sorted(rest, key=lambda k: (-state[k].numel(), k)):
            i = min(range(v), key=lambda i: (sizes[i], i))
            out[names[i]].append(k)
            sizes[i] += state[k].numel()
    else:
        for k in keys:
            hits = [i for i, group in enumerate(v) if any(_matches(p, k) for p in group)]
            if not hits:
                raise FragmentError(f"parameter {k!r} matches no fragment pattern (fragments: {v})")
            if len(hits) > 1:
                raise FragmentError(f"parameter {k!r} matches the patterns of fragments {hits}; each key needs one")
            out[names[hits[0]]].append(k)
    empty = [n for n in names if not out[n]]
    if empty:
        raise FragmentError(
            f"fragments={v if isinstance(v, int) else len(v)} leaves fragment(s) {empty} without parameters "
            f"(the model has {len(keys)} synced tensors); use fewer fragments"
        )
    order = {k: i for i, k in enumerate(keys)}

    def rank(p: str) -> tuple[int, int]:
        r = rows.get(p)
        return (order[p], 0) if r is None else (order[r[0]], r[1])

    return FragmentPlan(tuple(names), {n: tuple(sorted(out[n], key=rank)) for n in names}, rows)


#: the header entries of a fragment's delta (docs/spec.md, "Fragments")
HEADER_KEYS = ("fragment", "fragments", "base_fragment_step")


def _decimal(text: str, what: str, digits: int) -> int:
    if not isinstance(text, str) or not text.isdigit() or not text.isascii() or len(text) > digits or (
        len(text) > 1 and text[0] == "0"
    ):
        shown = text if len(str(text)) <= 40 else f"{text[:20]}... ({len(text)} characters)"
        raise FragmentError(f"header {what!r} must be a decimal integer of at most {digits} digits, got {shown!r}")
    return int(text)


def parse_fragment_header(md: Mapping[str, str]) -> tuple[str, int, int] | None:
    """``(fragment, fragment count, base_fragment_step)`` of a delta header, None when it names no
    fragment; :class:`FragmentError` when the entries are incomplete or malformed."""
    present = [k for k in HEADER_KEYS if k in md]
    if not present:
        return None
    if len(present) != len(HEADER_KEYS):
        raise FragmentError(f"header has {present} but not all of {list(HEADER_KEYS)}")
    count = _decimal(md["fragments"], "fragments", 4)
    index = _decimal(md["fragment"], "fragment", 4)
    if not 2 <= count <= MAX_FRAGMENTS or index >= count:
        raise FragmentError(f"header names fragment {index} of {count}")
    return str(index), count, _decimal(md["base_fragment_step"], "base_fragment_step", 18)
