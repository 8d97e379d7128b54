"""What the master checks before a delta may touch the global state.

Every rejection has a stable short ``reason`` code; the master logs it with the delta's
hub path, counts it in the round's metrics (``rejected_by_reason``) and records the delta
in the ledger, so a rejected delta is never downloaded or retried again.

Reasons, in the order the checks run:

=====================  ===================================================================
``replay``             the identity (node, local_step) is at or below the node's ledger mark,
                       or listed twice: it was already processed (never downloaded)
``size``               the listed or downloaded file is larger than a delta of this model can
                       honestly be (:func:`~diloco_lightning.wire.delta.max_delta_bytes`), or its
                       header is: refused before it is downloaded, or while it is
``download``           the download failed ``max_download_attempts`` times in a row
``unreadable``         not a safetensors file (truncated, garbage, inconsistent offsets)
``format``             header ``format`` is not ``diloco-delta/1`` (with ``compat="speedtronic"``, a header
                       without ``format`` is Speedtronic's, checked by :mod:`~diloco_lightning.master.compat`)
``header``             a header field missing or malformed
``node_id``            header ``node_id`` is not a valid node id
``path_mismatch``      header ``node_id`` / ``local_step`` differ from the file's hub path
``fragment``           the header's fragment entries are malformed, name a fragment this run has not
                       (or the run has fragments and the delta names none, or the reverse), or its
                       ``base_fragment_step`` cannot be that of its ``base_outer_step``
``negative_staleness`` ``base_outer_step`` is ahead of the master (a version it never published)
``max_staleness``      staleness above the master's ``max_staleness``
``too_stale``          the outer optimizer's gate is 0 at this staleness (e.g. CGAD beyond tau_cut)
``num_tokens``         ``weighting="tokens"`` and the header carries no positive ``num_tokens``
``missing_key``        a floating key of the global state is absent
``extra_key``          a key the global state has not (or not as a floating tensor)
``shape``              a tensor's shape differs from the global state's
``dtype``              a tensor dtype other than float32/bfloat16/float16 (complex64 for complex)
``encoding``           the header names an unknown encoding, or the parts are not a valid one:
                       missing, extra or mis-sized parts (checked from the header, before any
                       data is read), NaN/negative/huge scales, codes or top-k positions out of
                       range (docs/encoding.md, "Checking an untrusted file")
``fingerprint``        header ``model_fingerprint`` differs from the global state's
``signature``          the run is signed and the signature is missing or wrong
``non_finite``         a NaN or an infinity in a tensor
``norm``               L2 norm (of the decoded values, for an encoded delta) above the absolute bound ``max_delta_norm``
``norm_global``        L2 norm above ``norm_global_ratio`` x max(||global||, 0.01 sqrt(n))
``norm_relative``      L2 norm above ``norm_ratio`` x the median norm of recently accepted deltas
``non_finite_update``  the round's aggregate, or the state after the outer step, is not finite:
                       nothing is published and every delta of the round is refused
``invalid``            any other problem with the file's content (a last line of defence:
                       one delta's content never makes a round fail)
=====================  ===================================================================

A rejection never moves the ledger: only accepted deltas do. The master remembers a
refused file (its path and the hub's version token) so it is not read again, and deletes
it with its next publication.

Default bounds, from the first delta on: ``norm_global_ratio=100``. An honest
pseudo-gradient after H inner steps of Adam-like optimizers moves each coordinate by at
most about ``H * lr`` (Adam's step is bounded by its learning rate), so
``||delta|| <= H * lr * sqrt(n)``. The bound is ``100 * max(||global||, 0.01 * sqrt(n))``
>= ``sqrt(n)``, which leaves room for ``H * lr`` up to 1 (e.g. H = 500 inner steps at
lr 2e-3, or H = 2500 at DiLoCo's 4e-4), whatever the weights' scale; measured on the
tiny recipe, honest deltas are a fraction of a percent of that bound. A delta of norm 1e19
is refused as soon as it arrives, without the relative (median) bound's warm-up.

The relative bound is the robust outlier test of Byzantine-tolerant aggregation (a median
is not moved by a few bad values; cf. Yin et al. 2018, arXiv 1803.01498): it only engages
once ``norm_min_history`` accepted norms are known, and the window of accepted norms is
published with the optimizer state so a master that takes over decides exactly as the
previous one would have.

Fragments (``diloco_lightning/wire/fragments.py``): a fragment's delta is checked against that
fragment's keys only (names, shapes, dtypes, size bounds); its staleness is the fragment's outer
steps since its base (``outer_step`` count now minus the header's ``base_fragment_step``), and its
gate the optimizer's for that fragment (PA-CGAD: ``gate(max(tau, age_f))``). The norm bounds take
its norm scaled by ``sqrt(n / n_f)`` (``n_f`` the fragment's values), the norm a whole-model delta
of the same RMS would have, so the deltas of fragments of unequal sizes share one median window.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch

from diloco_lightning.wire.delta import (
    Delta,
    DeltaFileError,
    HeaderError,
    HeaderParser,
    parse_header,
    max_delta_bytes,
    max_header_bytes,
    read_delta,
    read_delta_header,
    synced_keys,
)
from diloco_lightning.encoding import EncodedTensor, sum_of_squares
from diloco_lightning.util.errors import DeltaRejected
from diloco_lightning.util.lanes import Lanes
from diloco_lightning.wire.arena import ReadArena
from diloco_lightning.wire.signing import RunKey

if TYPE_CHECKING:  # pragma: no cover
    from diloco_lightning.master.config import MasterConfig
    from diloco_lightning.master.gating import FragmentView

log = logging.getLogger(__name__)

__all__ = [
    "REASONS",
    "GLOBAL_RMS_FLOOR",
    "Accepted",
    "DeltaRejected",
    "DeltaValidator",
    "NormGuard",
    "delta_norm",
    "state_norm",
    "max_abs",
    "check_staleness",
]

REASONS = (
    "replay",
    "size",
    "download",
    "unreadable",
    "format",
    "header",
    "node_id",
    "path_mismatch",
    "negative_staleness",
    "max_staleness",
    "too_stale",
    "num_tokens",
    "missing_key",
    "extra_key",
    "shape",
    "dtype",
    "encoding",
    "fingerprint",
    "signature",
    "non_finite",
    "norm",
    "norm_global",
    "norm_relative",
    "non_finite_update",
    "invalid",
)


def delta_norm(tensors: Mapping[str, torch.Tensor | EncodedTensor]) -> float:
    """The L2 norm of all tensors together, accumulated in float64 (NaN/inf propagate).

    Half-precision tensors are reduced in FP32 without materialising a converted copy; an
    encoded tensor's norm is its decoded values', decoded chunk by chunk.
    """
    total = 0.0
    for t in tensors.values():
        if isinstance(t, EncodedTensor):
            total += sum_of_squares(t)
            continue
        if t.numel() == 0:
            continue
        if t.dtype in (torch.bfloat16, torch.float16):
            n = float(torch.linalg.vector_norm(t, dtype=torch.float32))
        else:
            n = float(torch.linalg.vector_norm(t))
        total += n * n
    return math.sqrt(total) if math.isfinite(total) else total


def has_non_finite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The first key holding a NaN or an infinity, else None."""
    for name in sorted(tensors):
        if not bool(torch.isfinite(tensors[name]).all()):
            return name
    return None


def check_staleness(tau: int, *, max_staleness: int | None, gate: float) -> None:
    """Raise :class:`DeltaRejected` for a negative staleness, one above ``max_staleness``, or a zero gate."""
    if tau < 0:
        raise DeltaRejected(
            "negative_staleness", f"base_outer_step is {-tau} version(s) ahead of the master (staleness {tau})"
        )
    if max_staleness is not None and tau > max_staleness:
        raise DeltaRejected("max_staleness", f"staleness {tau} > max_staleness {max_staleness}")
    if not gate > 0.0:
        raise DeltaRejected("too_stale", f"the outer optimizer's gate is 0 at staleness {tau}")


#: the floor of the global-relative bound, in RMS per coordinate (see the module docstring)
GLOBAL_RMS_FLOOR = 0.01


def state_norm(state: Mapping[str, torch.Tensor]) -> tuple[float, int]:
    """``(L2 norm, number of values)`` of the floating (and complex) tensors of a state."""
    keys = [k for k, t in state.items() if t.is_floating_point() or t.is_complex()]
    return delta_norm({k: state[k] for k in keys}), sum(state[k].numel() for k in keys)


def max_abs(t: torch.Tensor) -> float:
    """The largest magnitude in ``t`` (NaN if it holds a NaN), in one pass, without a temporary."""
    if t.numel() == 0:
        return 0.0
    return float(torch.linalg.vector_norm(t, ord=float("inf")))


class NormGuard:
    """Absolute, global-relative and median-relative bounds on a delta's L2 norm.

    Args:
        max_norm: reject norms above this (None: no absolute bound).
        ratio: reject norms above ``ratio * median(window)`` (None: no relative bound).
        window: how many recently accepted norms the median is taken over.
        min_history: the relative bound engages once this many norms are known.
        global_ratio: reject norms above ``global_ratio * max(||global||, 0.01 * sqrt(n))``
            (None: off); needs :meth:`set_global`.
    """

    def __init__(
        self,
        max_norm: float | None,
        ratio: float | None,
        window: int = 32,
        min_history: int = 4,
        global_ratio: float | None = None,
    ) -> None:
        self.max_norm = max_norm
        self.ratio = ratio
        self.min_history = min_history
        self.global_ratio = global_ratio
        self._global_bound: float | None = None
        self._norms: deque[float] = deque(maxlen=window)

    def set_global(self, norm: float, numel: int) -> None:
        """The global state the next deltas apply to: its L2 norm and number of values."""
        if self.global_ratio is None:
            self._global_bound = None
            return
        scale = max(norm, GLOBAL_RMS_FLOOR * math.sqrt(max(numel, 1))) if math.isfinite(norm) else math.inf
        self._global_bound = self.global_ratio * scale

    @property
    def norms(self) -> list[float]:
        return list(self._norms)

    def median(self) -> float | None:
        if len(self._norms) < max(1, self.min_history):
            return None
        return statistics.median(self._norms)

    def check(self, norm: float, tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        """Raise :class:`DeltaRejected` (``non_finite``, ``norm``, ``norm_relative``) or return."""
        if not math.isfinite(norm):
            bad = has_non_finite(tensors) if tensors is not None else None
            if bad is not None or tensors is None or math.isnan(norm):
                raise DeltaRejected("non_finite", f"key {bad!r} contains NaN or inf" if bad else "the norm is not finite")
            raise DeltaRejected("norm", "the L2 norm overflows")
        if self.max_norm is not None and norm > self.max_norm:
            raise DeltaRejected("norm", f"L2 norm {norm:.6g} > max_delta_norm {self.max_norm:.6g}")
        if self._global_bound is not None and norm > self._global_bound:
            raise DeltaRejected(
                "norm_global",
                f"L2 norm {norm:.6g} > {self.global_ratio:g} x max(||global||, {GLOBAL_RMS_FLOOR} sqrt(n)) = "
                f"{self._global_bound:.6g}",
            )
        if self.ratio is not None:
            med = self.median()
            if med is not None and norm > self.ratio * med:
                raise DeltaRejected(
                    "norm_relative",
                    f"L2 norm {norm:.6g} > {self.ratio:g} x median {med:.6g} of the last {len(self._norms)} accepted",
                )

    def extend(self, norms: Iterable[float]) -> None:
        for n in norms:
            if math.isfinite(n):
                self._norms.append(float(n))

    def load(self, norms: Iterable[float]) -> None:
        self._norms.clear()
        self.extend(norms)


@dataclass
class Accepted:
    """A delta that passed every check, as a round needs it (no tensors)."""

    ref: Any  # the hub's DeltaRef: node_id, local_step, path, size, version
    staleness: int
    gate: float
    weight: float
    norm: float
    #: the fragment the delta carries (None: a run without fragments)
    fragment: str | None = None

    @property
    def ident(self) -> str:
        return f"{self.ref.node_id}/{self.ref.local_step}"


class DeltaValidator:
    """Every check a delta passes before it may touch the global state (the module docstring's
    table, in that order), against the global state it would be applied to.

    Owns the norm bounds (:class:`NormGuard`, whose window of accepted norms is part of the
    published optimizer state: :meth:`state_dict` / :meth:`load_state_dict`).
    """

    def __init__(self, config: "MasterConfig", signing_key: RunKey | None, private_downloads: bool = True,
                 header_parser: HeaderParser | None = None) -> None:
        self.config = config
        self.signing_key = signing_key
        self.private_downloads = private_downloads
        #: how a header is parsed and checked (None: ``diloco-delta/1`` only; see master/compat.py)
        self.header_parser = header_parser
        self.norms = NormGuard(config.max_delta_norm, config.norm_ratio, config.norm_window, config.norm_min_history,
                               config.norm_global_ratio)
        self._global_for: tuple[int, int] | None = None  # (id of the state, outer_step) the global bound is for
        self._limits: tuple[str, int, int] | None = None
        #: the round's reused read buffer (``check(..., arena=)``): one delta's bytes, never a map of the file
        self.arena = ReadArena(Lanes(config.round_threads))

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {"norms": self.norms.norms}

    def state_with(self, norms: Iterable[float]) -> dict[str, Any]:
        """:meth:`state_dict` as it will be once the deltas of these ``norms`` are accepted: what a
        publication of them carries (:meth:`accept` makes it so once it is published)."""
        window = NormGuard(None, None, self.config.norm_window)
        window.load(self.norms.norms)
        window.extend(norms)
        return {"norms": window.norms}

    def accept(self, norms: Iterable[float]) -> None:
        """The deltas of these ``norms`` were applied and published: they join the median's window."""
        self.norms.extend(norms)

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        self.norms.load((state or {}).get("norms") or [])

    def note_global(self, state: Mapping[str, torch.Tensor], outer_step: int, norm: float, numel: int) -> None:
        """The norm of the state about to become ``outer_step`` (computed anyway by its finite
        check): the global-relative bound of the next deltas needs no pass of its own."""
        self.norms.set_global(norm, numel)
        self._global_for = (id(state), outer_step)

    # ------------------------------------------------------------------ limits

    def size_limits(self, state: Mapping[str, torch.Tensor], fingerprint: str) -> tuple[int, int]:
        """(max file bytes, max header bytes) of an honest delta of the model ``state`` is."""
        if self._limits is None or self._limits[0] != fingerprint:
            self._limits = (fingerprint, max_delta_bytes(state), max_header_bytes(len(synced_keys(state))))
        return self._limits[1], self._limits[2]

    def header_base(self, path: Path, state: Mapping[str, torch.Tensor], fingerprint: str) -> int:
        """The header's ``base_outer_step`` (arrival mode sorts by it), or -1 if the header is bad
        (the delta is then rejected with the reader's reason when its turn comes)."""
        try:
            return read_delta_header(path, max_header=self.size_limits(state, fingerprint)[1],
                                     header_parser=self.header_parser).base_outer_step
        except DeltaFileError:
            return -1

    # ------------------------------------------------------------------ checks

    def check(
        self,
        ref: Any,
        path: Path,
        *,
        state: Mapping[str, torch.Tensor],
        fingerprint: str,
        outer_step: int,
        gate: Callable[[int], float],
        fragments: "FragmentView | None" = None,
        arena: ReadArena | None = None,
    ) -> tuple[Delta, Accepted]:
        """Validate the downloaded delta ``path`` (hub path ``ref.path``) against ``state`` at
        ``outer_step``: ``(Delta, Accepted)``, or raises :class:`DeltaRejected` (the reader's
        ``DeltaFileError`` is one) with its ``reason``. Any other error from the file's content is a
        rejection too (``invalid``): one delta's content can never make a round fail. With ``arena``
        (a file read in place, as on a folder hub) the tensors are read into that reused buffer: the
        returned delta is valid until the next check with the same arena."""
        try:
            return self._check(ref, path, state, fingerprint, outer_step, gate, fragments, arena)
        except DeltaRejected:
            raise
        except Exception as e:  # noqa: BLE001 - a last line of defence: one delta never fails a round
            log.exception("unexpected error while checking %s", ref.path)
            raise DeltaRejected("invalid", f"{type(e).__name__}: {str(e)[:300]}") from None

    def _check(self, ref, path, state, fingerprint, outer_step, gate, fragments=None, arena=None) -> tuple[Delta, Accepted]:
        max_bytes, max_header = self.size_limits(state, fingerprint)
        header = read_delta_header(path, max_header=max_header, header_parser=self.header_parser)
        if header.node_id != ref.node_id or header.local_step != ref.local_step:
            raise DeltaRejected(
                "path_mismatch",
                f"header says {header.node_id}/{header.local_step}, the hub path {ref.node_id}/{ref.local_step}",
            )
        name, reference, parser, scale = None, state, self.header_parser, 1.0
        if fragments is None:
            tau = outer_step - header.base_outer_step
            if any(k in header.extra for k in ("fragment", "fragments", "base_fragment_step")):
                raise DeltaRejected("fragment", "the delta names a fragment; this run has no fragments")
            g = float(gate(tau)) if tau >= 0 else 0.0
        else:
            name, tau = fragments.staleness(header.extra, header.base_outer_step, outer_step)
            g = float(fragments.gate(name, tau)) if tau >= 0 else 0.0
            reference = fragments.plan.substate(name, state)
            max_bytes = max_delta_bytes(reference)
            scale = fragments.norm_scale(name, state)
            inner = self.header_parser or parse_header

            def parser(p, md, _inner=inner, _name=name):  # the file read is the file whose header was checked
                h = _inner(p, md)
                if h.extra.get("fragment") != _name:
                    raise HeaderError(p, "the header's fragment changed while the file was read")
                return h
        check_staleness(tau, max_staleness=self.config.max_staleness, gate=g)
        weight = 1.0
        if self.config.weighting == "tokens":
            if not header.num_tokens:
                raise DeltaRejected("num_tokens", "weighting='tokens' needs a positive num_tokens in the header")
            weight = float(header.num_tokens)
        delta = read_delta(
            path,
            reference=reference,
            hub_path=ref.path,
            expected_fingerprint=fingerprint,
            signing_key=self.signing_key,
            check_finite=False,  # the norm below is NaN/inf exactly when a value is
            max_file_bytes=max_bytes,
            # a file another writer can change (the folder hub's, read in place) is copied into owned
            # memory: mapped, a truncation under the reader would kill the process (SIGBUS); this
            # process's own download of a remote hub's file is mapped (no copy)
            copy=not self.private_downloads,
            header_parser=parser,
            arena=arena,
        )
        # summed as the reader read it (a reused buffer), else one pass now
        sumsq = delta.sumsq if delta.encoded is None else None
        norm = (math.sqrt(sumsq) if sumsq is not None and math.isfinite(sumsq) else
                sumsq if sumsq is not None else delta_norm(delta.by_key())) * scale
        if self._global_for != (id(state), outer_step):  # the global-relative bound: once per version
            self.norms.set_global(*state_norm(state))
            self._global_for = (id(state), outer_step)
        # decoded values of a valid encoding are finite: an infinite norm is an overflow ("norm")
        self.norms.check(norm, delta.tensors if delta.encoded is None else {})
        return delta, Accepted(ref, tau, g, weight, norm, name)
