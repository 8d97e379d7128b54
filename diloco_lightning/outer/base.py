"""The outer-optimizer base class: the contract every outer optimizer shares.

An outer optimizer turns pseudo-gradients ("deltas", ``anchor - local``; DiLoCo, Douillard et
al. 2023, arXiv 2311.08105) into updates of the global state. :class:`OuterOptimizer` holds
what is common to all of them:

- validation: every delta key must be in the global state with the same shape (``ValueError``
  naming the key, raised before anything changes); keys that are not floating point or complex
  on either side are skipped; a negative staleness is a ``ValueError``;
- buffers: CPU FP32 tensors (complex64 for complex parameters), one per floating key of the state
  per buffer family, created at construction (or on first use for keys added later);
- the FP32 work area: the math of every optimizer runs on contiguous CPU FP32 tensors, in place.
  A CPU FP32 (or complex64) contiguous state tensor is updated directly by the fused kernels; any
  other state tensor (bf16, fp16, non-contiguous, on an accelerator) is copied to FP32, updated,
  and written back, so it is rounded once per step. Float64/complex128 state keeps its precision:
  the FP32 update is computed on a zero tensor and added in the state's dtype. Deltas are
  converted to CPU FP32 (complex64). Such conversions go, in cache-sized chunks, to a small
  scratch area (:data:`TEMP_BUDGET_BYTES`) reused from step to step, so converting a large bf16
  model never holds a second full copy and runs close to the speed of the FP32 path;
- ``state_dict()`` / ``load_state_dict()``: a flat ``dict`` whose tensor entries are named
  ``"<buffer>/<key>"`` and whose other entries are plain Python scalars, strings and lists, so a
  master can save it as safetensors + JSON and another master continue bit-exactly;
- the buffers' precision (:meth:`OuterOptimizer.set_state_precision`, the options ``state_dtype``
  and ``stochastic_rounding`` of :func:`~diloco_lightning.outer.build_outer_optimizer`): FP32 by
  default; ``state_dtype="bfloat16"`` keeps the buffers of real keys in bf16 (half the memory: a 7B
  master's two FP32 Adam buffers are 56 GB). The math still runs in FP32: each step reads a chunk
  of a buffer into the FP32 scratch area (exact), updates it there, and rounds it back once, to
  nearest even (``torch``'s cast), or, with ``stochastic_rounding=True``, up or down with
  probabilities that make the rounding unbiased (random bits added below bf16's last mantissa
  bit, then truncated; :func:`stochastic_round_`), seeded by the step count, the key and the
  chunk, so a resumed master rounds exactly as the one it replaces. The state update itself uses
  the FP32 values before they are rounded, so one step equals an FP32 step started from the same
  (bf16) buffers. Complex keys keep complex64/FP32 buffers.

Subclasses implement :meth:`OuterOptimizer.gate` and :meth:`OuterOptimizer._apply`.
"""

from __future__ import annotations

import logging
import math
import numbers
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor

from diloco_lightning.outer.gates import check_staleness

__all__ = [
    "CHUNK_BYTES",
    "STATE_DTYPES",
    "TEMP_BUDGET_BYTES",
    "OuterOptimizer",
    "Work",
    "check_betas",
    "check_int",
    "check_real",
    "parse_state_dtype",
    "real_view",
    "stochastic_round_",
]

logger = logging.getLogger(__name__)

#: Size of the reusable FP32 scratch area for delta conversions and copies of non-FP32 state.
TEMP_BUDGET_BYTES = 16 * 1024 * 1024
#: Converted tensors are processed in chunks of this many FP32 bytes (about a core's share of cache).
CHUNK_BYTES = 4 * 1024 * 1024


def _is_trainable(tensor: Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _math_dtype(is_complex: bool) -> torch.dtype:
    return torch.complex64 if is_complex else torch.float32


def real_view(tensor: Tensor) -> Tensor:
    """``tensor`` itself, or ``torch.view_as_real(tensor)`` for a complex tensor."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


#: ``state_dtype`` names -> the dtype of the buffers of real keys
STATE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def parse_state_dtype(value: Any) -> torch.dtype:
    """``"float32"``/``"fp32"``/``"bfloat16"``/``"bf16"`` (or the torch dtype) -> torch dtype.

    Raises:
        ValueError: naming ``state_dtype`` for anything else.
    """
    if isinstance(value, torch.dtype) and value in STATE_DTYPES.values():
        return value
    if isinstance(value, str) and value.lower().removeprefix("torch.") in STATE_DTYPES:
        return STATE_DTYPES[value.lower().removeprefix("torch.")]
    raise ValueError(f"state_dtype must be one of 'float32', 'bfloat16' (or 'fp32', 'bf16'), got {value!r}")


def stochastic_round_(src: Tensor, generator: torch.Generator) -> Tensor:
    """Round the FP32 tensor ``src`` to bf16-representable values, in place, stochastically.

    A value between two neighbouring bf16 values ``lo < x < hi`` becomes ``hi`` with probability
    ``(x - lo) / (hi - lo)``, else ``lo`` (so ``E[round(x)] = x``): a uniform 16-bit integer is
    added to the low 16 bits of the FP32 bit pattern (the bits bf16 drops; a carry moves the
    value to the next bf16 value, through the exponent too), then those bits are cleared. On
    the sign-magnitude pattern this rounds the magnitude, so it works for both signs. NaN and
    infinities are left as they are. Returns ``src`` (its bf16 cast is then exact).
    """
    if src.dtype != torch.float32 or not src.is_contiguous():
        raise ValueError("stochastic_round_ needs a contiguous float32 tensor")
    bits = src.view(torch.int32)
    finite = torch.isfinite(src)
    noise = torch.randint(0, 1 << 16, src.shape, dtype=torch.int32, generator=generator)
    rounded = bits.add(noise).bitwise_and_(-(1 << 16))
    bits.copy_(torch.where(finite, rounded, bits))
    return src


# ----------------------------------------------------------------------------- option checks
def check_real(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Return ``value`` as a float after checking that it is a finite number in the given range.

    Raises:
        ValueError: naming ``name`` when ``value`` is not a finite real number in range.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")  # noqa: TRY004 (a bad option value)
    result = float(value)
    ok = math.isfinite(result)
    if ok and low is not None:
        ok = result > low if low_open else result >= low
    if ok and high is not None:
        ok = result < high if high_open else result <= high
    if not ok:
        lo = "-inf" if low is None else f"{low!r}"
        hi = "inf" if high is None else f"{high!r}"
        interval = f"{'(' if low_open or low is None else '['}{lo}, {hi}{')' if high_open or high is None else ']'}"
        raise ValueError(f"{name} must be a finite number in {interval}, got {value!r}")
    return result


def check_betas(betas: Any) -> tuple[float, float]:
    """Check Adam's ``betas``: two numbers in ``[0, 1)``."""
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}") from None
    return (
        check_real("betas[0]", beta1, low=0.0, high=1.0, high_open=True),
        check_real("betas[1]", beta2, low=0.0, high=1.0, high_open=True),
    )


# ----------------------------------------------------------------------------- work area
@dataclass(frozen=True)
class _Item:
    """One validated (state tensor, delta tensor) pair that a step will update."""

    key: str
    param: Tensor
    delta: Tensor


@dataclass(slots=True)
class Work:
    """One unit of math: flat FP32 views of (a chunk of) one state tensor, its delta and buffers.

    ``p`` and ``g`` are contiguous 1-D CPU FP32 tensors (``view_as_real`` of complex64 ones, so
    ``(n, 2)``, for a complex key); ``p`` aliases the state tensor itself when that is already CPU
    FP32 contiguous. ``bufs`` maps each buffer family to the matching slice (real view for complex).
    """

    key: str
    p: Tensor
    g: Tensor
    bufs: dict[str, Tensor]
    is_complex: bool
    target: Tensor  # the state tensor (or its flat slice) that p stands for
    p_math: Tensor  # p before view_as_real, shaped like target
    writeback: str | None  # None (p is the state tensor), "copy" or "add"
    #: (stored buffer slice, its FP32 copy in bufs, seed label) for low-precision buffers: rounded back after the math
    buffer_back: list[tuple[Tensor, Tensor, str]] = field(default_factory=list)

    def write_back(self) -> None:
        if self.writeback == "copy":
            self.target.copy_(self.p_math)
        elif self.writeback == "add":
            self.target.add_(self.p_math.to(self.target.device))


_ALIGN = 16  # scratch offsets in FP32 elements (64 bytes)


def _usable(tensor: Tensor, dtype: torch.dtype) -> bool:
    return tensor.dtype == dtype and tensor.device.type == "cpu" and tensor.is_contiguous()


class _Unit(NamedTuple):
    """Elements ``[start, stop)`` of one item (the whole tensor, in its shape, when ``whole``)."""

    item: _Item
    start: int
    stop: int
    whole: bool
    is_complex: bool
    delta_ok: bool  # the delta is already CPU FP32 (complex64) contiguous
    param_ok: bool  # the state tensor is already CPU FP32 (complex64) contiguous
    floats: int  # FP32 elements of one converted copy
    need: int  # FP32 scratch elements (aligned) this unit takes


def _units(item: _Item, chunk_floats: int, buffer_conversions: int = 0) -> list[_Unit]:
    """Split an item that needs conversions into cache-sized chunks (when both sides are contiguous).
    ``buffer_conversions``: the item's buffers kept in a low precision (each takes an FP32 copy)."""
    param, delta = item.param, item.delta
    is_complex = param.is_complex()
    dtype = _math_dtype(is_complex)
    delta_ok, param_ok = _usable(delta, dtype), _usable(param, dtype)
    conversions = (not delta_ok) + (not param_ok) + buffer_conversions
    n = param.numel()
    width = 2 if is_complex else 1
    chunk = max(1, chunk_floats // width)
    if conversions == 0 or n <= chunk or not (param.is_contiguous() and delta.is_contiguous()):
        bounds = [(0, n)]
    else:
        bounds = [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
    units = []
    for start, stop in bounds:
        floats = (stop - start) * width
        need = -(-floats // _ALIGN) * _ALIGN * conversions
        units.append(_Unit(item, start, stop, len(bounds) == 1, is_complex, delta_ok, param_ok, floats, need))
    return units


# ----------------------------------------------------------------------------- base class
class OuterOptimizer:
    """Base class of the outer optimizers (see the module docstring for the shared contract).

    Attributes:
        name: the registry name (``build_outer_optimizer(name, ...)``).
        options: the constructor options, JSON-serialisable, such that
            ``build_outer_optimizer(opt.name, state, **opt.options)`` builds the same optimizer.
    """

    name: ClassVar[str] = ""
    #: Buffer families: name -> whether the buffer is complex for a complex key (else always real).
    BUFFERS: ClassVar[dict[str, bool]] = {}
    #: Per-key scalars (step counts, buffer scales): state_dict name -> (kind, initial value), kind
    #: being "count" (int >= 0), "scale" (float >= 0) or "positive" (float > 0).
    KEY_SCALARS: ClassVar[dict[str, tuple[str, Any]]] = {}
    #: ``state_dict()["optimizer"]`` values that ``load_state_dict`` accepts.
    STATE_KINDS: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        state: Mapping[str, Tensor],
        options: dict[str, Any],
        *,
        buffers: Mapping[str, bool] | None = None,
        key_scalars: Mapping[str, tuple[str, Any]] | None = None,
    ) -> None:
        """``buffers`` / ``key_scalars`` override the class's ``BUFFERS`` / ``KEY_SCALARS`` layout."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping of str to Tensor, got {type(state).__name__}")
        self.options: dict[str, Any] = options
        self._families: dict[str, bool] = dict(self.BUFFERS if buffers is None else buffers)
        self._scalar_kinds: dict[str, tuple[str, Any]] = dict(self.KEY_SCALARS if key_scalars is None else key_scalars)
        self._specs: dict[str, tuple[tuple[int, ...], bool]] = {}
        self._buffers: dict[str, dict[str, Tensor]] = {family: {} for family in self._families}
        self._key_scalars: dict[str, dict[str, Any]] = {name: {} for name in self._scalar_kinds}
        self._scratch: Tensor | None = None
        self._views: dict[str, dict[str, Tensor]] = {}
        self._state_dtype: torch.dtype = torch.float32  # of the buffers of real keys (set_state_precision)
        self._stochastic = False
        self._rounding_step = 0  # steps taken with stochastic rounding (seeds the rounding; in state_dict)
        for key, tensor in state.items():
            self._check_state_entry(key, tensor)
            if _is_trainable(tensor):
                self._register(key, tensor)

    # --------------------------------------------------------------------- public API
    @property
    def state_dtype(self) -> torch.dtype:
        """The dtype of the buffers of real keys (FP32 unless :meth:`set_state_precision` said otherwise)."""
        return self._state_dtype

    def set_state_precision(self, state_dtype: Any = "float32", stochastic_rounding: bool = False) -> None:
        """Keep the buffers of real keys in ``state_dtype`` (``"float32"`` or ``"bfloat16"``), rounded
        back after each step to nearest even or, with ``stochastic_rounding``, stochastically (see the
        module docstring). Existing buffers are converted now (to nearest). Recorded in
        :attr:`options` when not the default, so ``build_outer_optimizer(opt.name, state, **opt.options)``
        builds the same optimizer.

        Raises:
            ValueError: on an unknown ``state_dtype``, or ``stochastic_rounding`` that is not a bool
                or is asked with FP32 buffers (there is nothing to round).
        """
        dtype = parse_state_dtype(state_dtype)
        if not isinstance(stochastic_rounding, bool):
            raise ValueError(f"stochastic_rounding must be True or False, got {stochastic_rounding!r}")  # noqa: TRY004
        if stochastic_rounding and dtype == torch.float32:
            raise ValueError("stochastic_rounding needs state_dtype='bfloat16' (FP32 buffers are not rounded)")
        self._state_dtype, self._stochastic = dtype, stochastic_rounding
        for family, buffers in self._buffers.items():
            for key, buf in list(buffers.items()):
                want = self._buffer_dtype(family, key)
                if buf.dtype != want:
                    buffers[key] = buf.to(want)
        self._views = {}
        self.options.pop("state_dtype", None)
        self.options.pop("stochastic_rounding", None)
        if dtype != torch.float32:
            self.options["state_dtype"] = "bfloat16"
            if stochastic_rounding:
                self.options["stochastic_rounding"] = True

    def gate(self, staleness: float) -> float:
        """The scale this optimizer puts on a pseudo-gradient of the given staleness."""
        check_staleness(staleness)
        return 1.0

    def step(
        self,
        state: dict[str, Tensor],
        delta: Mapping[str, Tensor],
        staleness: float = 0,
        *,
        gated: bool = False,
        fragment: str | None = None,
    ) -> bool:
        """Apply one outer update to ``state`` in place (in each tensor's own dtype).

        Args:
            state: the global state; its floating and complex tensors are updated in place.
            delta: the pseudo-gradient, ``anchor - local`` (any dtype or device; converted to CPU FP32).
            staleness: ``outer_step at application - base_outer_step`` of the delta.
            gated: the caller already multiplied ``delta`` by ``gate(staleness)``; it is not gated
                again, but ``staleness`` is still validated and a step whose gate is 0 is still a no-op.
            fragment: the fragment the delta carries (:class:`PACGAD` only; ignored by the others,
                which update exactly the keys the delta carries).

        Returns:
            ``False`` when the step was fully gated (nothing changed at all), else ``True``.

        Raises:
            ValueError: on a negative staleness, a delta key missing from ``state`` or with another
                shape (naming the key); nothing is changed then.
        """
        tau = check_staleness(staleness)
        if not isinstance(gated, bool):
            raise TypeError(f"gated must be a bool, got {gated!r}")
        if fragment is not None and not isinstance(fragment, str):
            raise TypeError(f"fragment must be a str or None, got {fragment!r}")
        items = self._plan(state, delta)
        with torch.no_grad():
            applied = self._apply(items, tau, gated, fragment)
        if applied and self._stochastic:
            self._rounding_step += 1
        logger.debug(
            "%s step: staleness=%s gated=%s fragment=%s keys=%d applied=%s",
            self.name,
            tau,
            gated,
            fragment,
            len(items),
            applied,
        )
        return applied

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """Buffers (cloned CPU tensors, ``"<buffer>/<key>"``) and counters (plain Python values).

        ``copy=False`` hands out the live buffers instead (no extra memory): for a caller that
        writes them out before the next step, as the master's publication does."""
        out: dict[str, Any] = {"optimizer": self.name}
        out.update(self._scalar_state())
        if self._stochastic:
            out["rounding_step"] = self._rounding_step
        if self._scalar_kinds:
            keys = list(self._specs)
            out["keys"] = keys
            for name, per_key in self._key_scalars.items():
                out[name] = [per_key[k] for k in keys]
        for family, buffers in self._buffers.items():
            for key, buf in buffers.items():
                out[f"{family}/{key}"] = buf.clone() if copy else buf
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Replace buffers and counters by those of ``state_dict`` (as made by :meth:`state_dict`).

        Tensors are copied to CPU FP32 (complex64). Buffers and counters absent from ``state_dict``
        are reset (so ``load_state_dict({})`` restarts from scratch). Everything is validated before
        anything changes.

        Raises:
            ValueError: on an entry that does not belong to this optimizer's state (naming it).
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        kind = state_dict.get("optimizer", None)
        if kind is not None and kind not in self.STATE_KINDS:
            raise ValueError(f"state_dict is for optimizer {kind!r}; {self.name} loads one of {list(self.STATE_KINDS)}")
        tensors = {k: v for k, v in state_dict.items() if isinstance(v, Tensor)}
        scalars = {k: v for k, v in state_dict.items() if not isinstance(v, Tensor) and k != "optimizer"}
        rounding_step = self._pop_rounding_step(scalars)
        buffers = self._parse_buffers(tensors)
        key_scalars = self._parse_key_scalars(scalars)  # pops the per-key entries
        checked = self._check_scalar_state(scalars)
        self._set_buffers(buffers)
        self._key_scalars = key_scalars
        self._set_scalar_state(checked)
        self._rounding_step = rounding_step

    @staticmethod
    def _pop_rounding_step(scalars: dict[str, Any]) -> int:
        """The ``rounding_step`` entry (stochastic rounding's step count), removed from ``scalars``; 0 if absent."""
        return check_int("rounding_step", scalars.pop("rounding_step", 0), low=0)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({opts})"

    # --------------------------------------------------------------------- for subclasses
    def _apply(self, items: list[_Item], tau: float, gated: bool, fragment: str | None) -> bool:
        raise NotImplementedError

    def _scalar_state(self) -> dict[str, Any]:
        return {}

    def _check_scalar_state(self, scalars: dict[str, Any]) -> dict[str, Any]:
        if scalars:
            raise ValueError(f"unexpected entries in {self.name} state_dict: {sorted(scalars)}")
        return {}

    def _set_scalar_state(self, scalars: dict[str, Any]) -> None:
        pass

    def _buffer(self, family: str, key: str) -> Tensor:
        """The ``family`` buffer of ``key`` (created as zeros on first use)."""
        buffers = self._buffers[family]
        buf = buffers.get(key)
        if buf is None:
            buf = buffers[key] = torch.zeros(self._specs[key][0], dtype=self._buffer_dtype(family, key))
        return buf

    def _buffer_dtype(self, family: str, key: str) -> torch.dtype:
        """What ``family``'s buffer of ``key`` is stored in: complex64 for a complex buffer, FP32 for the
        real buffers of a complex key, else the state dtype (FP32 or bf16)."""
        is_complex = self._specs[key][1]
        if is_complex:
            return _math_dtype(self._families[family])
        return self._state_dtype

    def _run(self, items: list[_Item], fn: Callable[[list[Work]], None]) -> None:
        """Call ``fn`` on batches of :class:`Work` (flat FP32 views of the items), then write back.

        Keys not seen at construction get their buffers here. Conversions (a delta that is not CPU
        FP32, a state tensor that is not CPU FP32 contiguous) go to a scratch area of
        :data:`TEMP_BUDGET_BYTES` kept between steps (fresh allocations of that size would
        page-fault on every step), in chunks of :data:`CHUNK_BYTES` so that a converted chunk is
        still in cache when the kernel reads it; a batch closes when the scratch area is full.
        ``fn`` must treat each :class:`Work` on its own (chunks of one key may land in different
        batches): per-key scalars are to be read before and written after :meth:`_run`.
        """
        low = 0 if self._state_dtype == torch.float32 else len(self._families)
        units = [u for item in items
                 for u in _units(item, CHUNK_BYTES // 4, 0 if item.param.is_complex() else low)]
        needs = [u.need for u in units]
        if any(needs):
            size = max(TEMP_BUDGET_BYTES // 4, *needs)
            if self._scratch is None or self._scratch.numel() < size:
                self._scratch = None  # free the old area first
                self._scratch = torch.empty(size, dtype=torch.float32)
        scratch = self._scratch
        offset = 0

        def take(unit: _Unit) -> Tensor:
            nonlocal offset
            n = unit.floats
            assert scratch is not None and offset + n <= scratch.numel()
            flat = scratch[offset : offset + n]
            offset += -(-n // _ALIGN) * _ALIGN
            return flat.view(torch.complex64) if unit.item.param.is_complex() else flat

        batch: list[Work] = []
        for unit, need in zip(units, needs):
            key = unit.item.key
            if key not in self._specs:
                self._register(key, unit.item.param)
            if scratch is not None and offset + need > scratch.numel():
                self._flush(batch, fn)
                batch, offset = [], 0
            batch.append(self._make_work(unit, take))
        if batch:
            self._flush(batch, fn)

    def _flush(self, batch: list[Work], fn: Callable[[list[Work]], None]) -> None:
        fn(batch)
        for work in batch:
            work.write_back()
            for stored, math_copy, label in work.buffer_back:
                if self._stochastic:
                    seed = zlib.crc32(f"{self._rounding_step}:{label}".encode())
                    stochastic_round_(math_copy, torch.Generator().manual_seed(seed))
                stored.copy_(math_copy)  # to nearest even (exact after a stochastic rounding)

    def _make_work(self, unit: _Unit, take: Callable[[_Unit], Tensor]) -> Work:
        item = unit.item
        param, delta = item.param, item.delta.detach()
        whole, start, stop = unit.whole, unit.start, unit.stop
        if unit.delta_ok:
            g = delta if whole else delta.view(-1)[start:stop]
        else:
            g = take(unit)
            if whole:
                g = g.view(param.shape)
                g.copy_(delta)
            else:
                g.copy_(delta.view(-1)[start:stop])
        mode: str | None
        if unit.param_ok:
            p, target, mode = (param if whole else param.view(-1)[start:stop]), param, None
        else:
            target = param if whole else param.view(-1)[start:stop]
            p = take(unit).view(target.shape)
            if param.dtype in (torch.float64, torch.complex128):
                # Keep the state's precision: compute the FP32 update on zeros, add it in float64.
                p.zero_()
                mode = "add"
            else:
                p.copy_(target)
                mode = "copy"
        p_math = p
        back: list[tuple[Tensor, Tensor, str]] = []
        if unit.is_complex or self._state_dtype == torch.float32:
            if whole:
                bufs = self._buffer_views(item.key)
            else:
                bufs = {family: real_view(self._buffer(family, item.key).view(-1)[start:stop]) for family in self._families}
        else:  # low-precision buffers: an FP32 copy of each, rounded back in _flush
            bufs = {}
            for family in self._families:
                buf = self._buffer(family, item.key)
                stored = buf if whole else buf.view(-1)[start:stop]
                math_copy = take(unit).view(stored.shape)
                math_copy.copy_(stored)
                bufs[family] = math_copy
                back.append((stored, math_copy, f"{family}/{item.key}/{start}"))
        if unit.is_complex:
            p, g = torch.view_as_real(p), torch.view_as_real(g)
        return Work(item.key, p, g, bufs, unit.is_complex, target, p_math, mode, back)

    def _buffer_views(self, key: str) -> dict[str, Tensor]:
        """``{family: real view of key's buffer}``, cached (the buffers are updated in place)."""
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = {family: real_view(self._buffer(family, key)) for family in self._families}
        return views

    def _set_buffers(self, buffers: dict[str, dict[str, Tensor]]) -> None:
        self._buffers = buffers
        self._views = {}

    def _group(self, batch: list[Work], names: tuple[str, ...]) -> dict[tuple[Any, ...], list[Work]]:
        """Split ``batch`` by the values of the per-key scalars ``names`` (one kernel call per group)."""
        groups: dict[tuple[Any, ...], list[Work]] = {}
        for w in batch:
            groups.setdefault(tuple(self._key_scalars[n][w.key] for n in names), []).append(w)
        return groups

    # --------------------------------------------------------------------- validation
    @staticmethod
    def _check_state_entry(key: Any, tensor: Any) -> None:
        if not isinstance(key, str):
            raise TypeError(f"state keys must be str, got {key!r}")
        if not isinstance(tensor, Tensor):
            raise TypeError(f"state[{key!r}] is not a tensor: {type(tensor).__name__}")

    def _register(self, key: str, tensor: Tensor) -> None:
        self._specs[key] = (tuple(tensor.shape), tensor.is_complex())
        for family in self._families:
            self._buffer(family, key)
        for name, (_, initial) in self._scalar_kinds.items():
            self._key_scalars[name][key] = initial

    def _plan(self, state: Mapping[str, Tensor], delta: Mapping[str, Tensor]) -> list[_Item]:
        """Validate ``delta`` against ``state`` (nothing is changed) and list what a step updates."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping of str to Tensor, got {type(state).__name__}")
        if not isinstance(delta, Mapping):
            raise TypeError(f"delta must be a mapping of str to Tensor, got {type(delta).__name__}")
        items = []
        seen: dict[tuple, str] = {}
        for key, d in delta.items():
            if key not in state:
                raise ValueError(f"delta key {key!r} is not in the global state")
            param = state[key]
            self._check_state_entry(key, param)
            if not isinstance(d, Tensor):
                raise TypeError(f"delta[{key!r}] is not a tensor: {type(d).__name__}")
            if d.shape != param.shape:
                raise ValueError(
                    f"shape mismatch for key {key!r}: delta {tuple(d.shape)} vs state {tuple(param.shape)}"
                )
            if not (_is_trainable(param) and _is_trainable(d)):
                continue
            if d.is_complex() and not param.is_complex():
                raise ValueError(f"delta for key {key!r} is complex but the state tensor is {param.dtype}")
            spec = self._specs.get(key)
            if spec is not None and (spec[0] != param.shape or spec[1] != param.is_complex()):
                raise ValueError(
                    f"state tensor {key!r} is {tuple(param.shape)} {param.dtype}, but the optimizer's "
                    f"buffers were made for shape {spec[0]} ({'complex' if spec[1] else 'real'})"
                )
            if param.numel() > 0:
                # Tied weights (two keys, one storage) are updated once, through the first key.
                alias = (param.device, param.data_ptr(), param.dtype, tuple(param.shape), param.stride())
                if alias in seen:
                    logger.warning("delta key %r aliases %r in the global state; updated once", key, seen[alias])
                    continue
                seen[alias] = key
            items.append(_Item(key, param, d))
        return items

    def _parse_buffers(self, tensors: Mapping[str, Tensor]) -> dict[str, dict[str, Tensor]]:
        buffers: dict[str, dict[str, Tensor]] = {family: {} for family in self._families}
        for name, tensor in tensors.items():
            family, sep, key = name.partition("/")
            if not sep or family not in self._families:
                raise ValueError(
                    f"unexpected tensor {name!r} in {self.name} state_dict "
                    f"(expected '<buffer>/<key>' with buffer in {sorted(self._families)})"
                )
            buffers[family][key] = self._checked_buffer(name, key, tensor, self._families[family])
        # Keys with no saved buffer restart from zero.
        for family, per_key in buffers.items():
            for key, (shape, _) in self._specs.items():
                if key not in per_key:
                    per_key[key] = torch.zeros(shape, dtype=self._buffer_dtype(family, key))
        return buffers

    def _parse_key_scalars(self, scalars: dict[str, Any]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {
            name: {key: initial for key in self._specs} for name, (_, initial) in self._scalar_kinds.items()
        }
        if not self._scalar_kinds:
            return out
        keys = scalars.pop("keys", None)
        lists = {name: scalars.pop(name, None) for name in self._scalar_kinds}
        if keys is None:
            if any(v is not None for v in lists.values()):
                raise ValueError(f"{self.name} state_dict has per-key entries but no 'keys'")
            return out
        if not isinstance(keys, (list, tuple)) or len(set(keys)) != len(keys):
            raise ValueError("state_dict 'keys' must be a list of distinct key names")
        for key in keys:
            if key not in self._specs:
                raise ValueError(f"state_dict 'keys' names {key!r}, not a floating key of the global state")
        for name, values in lists.items():
            kind = self._scalar_kinds[name][0]
            if values is None:
                continue
            if not isinstance(values, (list, tuple)) or len(values) != len(keys):
                raise ValueError(f"state_dict {name!r} must be a list of {len(keys)} values (one per 'keys' entry)")
            for key, value in zip(keys, values):
                label = f"{name}[{key!r}]"
                if kind == "count":
                    out[name][key] = check_int(label, value, low=0)
                else:
                    out[name][key] = check_real(label, value, low=0.0, low_open=kind == "positive")
        return out

    def _checked_buffer(self, name: str, key: str, tensor: Tensor, follows_complex: bool) -> Tensor:
        spec = self._specs.get(key)
        if spec is None:
            raise ValueError(f"state_dict entry {name!r}: {key!r} is not a floating key of the global state")
        shape, is_complex = spec
        if tuple(tensor.shape) != shape:
            raise ValueError(f"state_dict entry {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
        want_complex = is_complex and follows_complex
        if not _is_trainable(tensor) or (tensor.is_complex() and not want_complex):
            raise ValueError(f"state_dict entry {name!r} has dtype {tensor.dtype}")
        family = name.partition("/")[0]
        # FP32 -> bf16 rounds to nearest (a state saved by an FP32 master loaded by a bf16 one)
        return tensor.detach().to(device="cpu", dtype=self._buffer_dtype(family, key), copy=True)


def check_int(name: str, value: Any, *, low: int) -> int:
    """Return ``value`` as an int after checking that it is an integer ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)
