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
  (bf16) buffers. ``state_dtype="int8"`` keeps them as 8-bit blockwise codes (a quarter of FP32;
  :mod:`~diloco_lightning.outer.blockwise`: ``state_dict()`` has the uint8 codes under
  ``"<buffer>/<key>"`` and their FP32 block maxima under ``"<buffer>.absmax/<key>"``), read into FP32
  and stored back the same way. Complex keys keep complex64/FP32 buffers.

Subclasses implement :meth:`OuterOptimizer.gate` and :meth:`OuterOptimizer._apply`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from diloco_lightning.outer.buffers import BufferStore, is_trainable, real_view
from diloco_lightning.outer.checks import check_betas, check_int, check_real
from diloco_lightning.outer.gates import check_staleness
from diloco_lightning.outer.precision import STATE_DTYPE_NAMES, STATE_DTYPES, parse_state_dtype, stochastic_round_
from diloco_lightning.outer.work import CHUNK_BYTES, TEMP_BUDGET_BYTES, Item, Work, WorkArea

__all__ = [
    "CHUNK_BYTES",
    "STATE_DTYPES",
    "BufferStore",
    "TEMP_BUDGET_BYTES",
    "Item",
    "OuterOptimizer",
    "Work",
    "WorkArea",
    "check_betas",
    "check_int",
    "check_real",
    "parse_state_dtype",
    "real_view",
    "stochastic_round_",
]

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- base class
class OuterOptimizer:
    """Base class of the outer optimizers (see the module docstring for the shared contract).

    Its parts: the buffers (a :class:`~diloco_lightning.outer.buffers.BufferStore`) and the FP32 work
    area over them (a :class:`~diloco_lightning.outer.work.WorkArea`, :meth:`_run`); a subclass adds
    its step (:meth:`_apply`), its gate and its scalar state.

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
    #: The step reads the staleness beyond the scalar gate (a per-coordinate correction, as the
    #: gap-aware optimizers make): a round's mean is then stepped with the round's largest staleness.
    STEP_USES_STALENESS: ClassVar[bool] = False
    #: Buffer families whose values are never negative (8-bit: the unsigned code book).
    NONNEGATIVE: ClassVar[frozenset[str]] = frozenset()
    #: The optimizer gates each fragment on its own age (PA-CGAD): a delta's gate is
    #: ``fragment_gate(fragment, tau)``, its step is told the delta's ``fragment``, a round's mean of
    #: such gated deltas is stepped with ``step_pregated``, and a run's fragments become its
    #: ``fragments`` option. The master asks this (:func:`~diloco_lightning.outer.gates_per_fragment`).
    GATES_PER_FRAGMENT: ClassVar[bool] = False

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
        self._store = BufferStore(self.BUFFERS if buffers is None else buffers, self.NONNEGATIVE, self.name)
        self._work = WorkArea(self._store)
        self._scalar_kinds: dict[str, tuple[str, Any]] = dict(self.KEY_SCALARS if key_scalars is None else key_scalars)
        self._key_scalars: dict[str, dict[str, Any]] = {name: {} for name in self._scalar_kinds}
        for key, tensor in state.items():
            self._check_state_entry(key, tensor)
            if is_trainable(tensor):
                self._register(key, tensor)

    # --------------------------------------------------------------------- public API
    @property
    def state_dtype(self) -> torch.dtype:
        """The dtype of the buffers of real keys (FP32 unless :meth:`set_state_precision` said otherwise)."""
        return self._store.state_dtype

    @property
    def track_precision(self) -> bool:
        """Measure what the buffers' precision does at each step (:attr:`precision_stats`); off by
        default (it costs passes)."""
        return self._work.track_precision

    @track_precision.setter
    def track_precision(self, on: bool) -> None:
        self._work.track_precision = bool(on)

    @property
    def precision_stats(self) -> dict[str, dict[str, float]]:
        """Per low-precision buffer family, for the last step: ``floor`` (the fraction of values stored
        as 0 although not 0) and ``stuck`` (stored unchanged although the step changed them)."""
        return self._work.precision_stats

    def set_state_precision(self, state_dtype: Any = "float32", stochastic_rounding: bool = False) -> None:
        """Keep the buffers of real keys in ``state_dtype`` (``"float32"``, ``"bfloat16"`` or ``"int8"``),
        rounded back after each step to nearest (even) or, bf16 with ``stochastic_rounding``,
        stochastically (see the module docstring). Existing buffers are converted now (to nearest). Recorded in
        :attr:`options` when not the default, so ``build_outer_optimizer(opt.name, state, **opt.options)``
        builds the same optimizer.

        Raises:
            ValueError: on an unknown ``state_dtype``, or ``stochastic_rounding`` that is not a bool
                or is asked with FP32 buffers (there is nothing to round).
        """
        dtype = parse_state_dtype(state_dtype)
        if not isinstance(stochastic_rounding, bool):
            raise ValueError(f"stochastic_rounding must be True or False, got {stochastic_rounding!r}")  # noqa: TRY004
        if stochastic_rounding and dtype != torch.bfloat16:
            raise ValueError("stochastic_rounding needs state_dtype='bfloat16' (FP32 buffers are not rounded; "
                             "8-bit ones round to the nearest code)")
        self._store.set_precision(dtype, stochastic_rounding)
        self.options.pop("state_dtype", None)
        self.options.pop("stochastic_rounding", None)
        if dtype != torch.float32:
            self.options["state_dtype"] = STATE_DTYPE_NAMES[dtype]
            if stochastic_rounding:
                self.options["stochastic_rounding"] = True

    def gate(self, staleness: float) -> float:
        """The scale this optimizer puts on a pseudo-gradient of the given staleness."""
        check_staleness(staleness)
        return 1.0

    def linear_rate(self) -> float | None:
        """``r`` when a step is exactly ``state -= r * gate * g`` (a momentum-free SGD: nothing of an
        earlier step carries over), else None (momentum, Adam: a delta's effect spreads over later
        steps). The master publishes what each node's delta got from it (``master.delta_scales``)."""
        return None

    def lookahead(self, steps: float) -> dict[str, Tensor] | None:
        """What this optimizer's own state adds to the global over its next ``steps`` outer steps,
        whatever deltas they apply (DANA's look-ahead, Hakimi et al. 2019), per key; None when
        nothing of an earlier step carries over (or this optimizer does not say)."""
        return None

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
        if applied and self._store.stochastic:
            self._store.rounding_step += 1
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
        if self._store.stochastic:
            out["rounding_step"] = self._store.rounding_step
        if self._scalar_kinds:
            keys = list(self._store.specs)
            out["keys"] = keys
            for name, per_key in self._key_scalars.items():
                out[name] = [per_key[k] for k in keys]
        out.update(self._store.state_dict(copy))
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
        buffers = self._store.parse(tensors)
        key_scalars = self._parse_key_scalars(scalars)  # pops the per-key entries
        checked = self._check_scalar_state(scalars)
        self._store.replace(buffers)
        self._key_scalars = key_scalars
        self._set_scalar_state(checked)
        self._store.rounding_step = rounding_step

    @staticmethod
    def _pop_rounding_step(scalars: dict[str, Any]) -> int:
        """The ``rounding_step`` entry (stochastic rounding's step count), removed from ``scalars``; 0 if absent."""
        return check_int("rounding_step", scalars.pop("rounding_step", 0), low=0)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({opts})"

    # --------------------------------------------------------------------- for subclasses
    def _apply(self, items: list[Item], tau: float, gated: bool, fragment: str | None) -> bool:
        raise NotImplementedError

    def _scalar_state(self) -> dict[str, Any]:
        return {}

    def _check_scalar_state(self, scalars: dict[str, Any]) -> dict[str, Any]:
        if scalars:
            raise ValueError(f"unexpected entries in {self.name} state_dict: {sorted(scalars)}")
        return {}

    def _set_scalar_state(self, scalars: dict[str, Any]) -> None:
        pass

    def _run(self, items: list[Item], fn: Callable[[list[Work]], None]) -> None:
        """Call ``fn`` on batches of :class:`Work` (flat FP32 views of the items and their buffers),
        then write back (:meth:`WorkArea.run <diloco_lightning.outer.work.WorkArea.run>`). Keys not
        seen at construction get their buffers (and per-key scalars) first."""
        for item in items:
            if item.key not in self._store.specs:
                self._register(item.key, item.param)
        self._work.run(items, fn)

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
        self._store.register(key, tensor)
        for name, (_, initial) in self._scalar_kinds.items():
            self._key_scalars[name][key] = initial

    def _plan(self, state: Mapping[str, Tensor], delta: Mapping[str, Tensor]) -> list[Item]:
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
            if not (is_trainable(param) and is_trainable(d)):
                continue
            if d.is_complex() and not param.is_complex():
                raise ValueError(f"delta for key {key!r} is complex but the state tensor is {param.dtype}")
            spec = self._store.specs.get(key)
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
            items.append(Item(key, param, d))
        return items

    def _parse_key_scalars(self, scalars: dict[str, Any]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {
            name: {key: initial for key in self._store.specs} for name, (_, initial) in self._scalar_kinds.items()
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
            if key not in self._store.specs:
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
