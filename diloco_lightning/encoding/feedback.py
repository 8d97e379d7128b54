"""What a worker sends for a pseudo-gradient: its encoding, with error feedback.

:func:`encode_delta` is the one step from a pseudo-gradient (``anchor - local``, FP32, one
tensor per synced key) to what travels: each tensor encoded with the run's
:class:`~diloco_lightning.encoding.EncodingSpec` (``docs/encoding.md``), after adding the
**error-feedback residual**, what the previous rounds' encodings dropped. It returns the new
residual, ``x - decode(encode(x))`` with ``x = delta + residual``, to add to the next round's
delta, so nothing is lost over time: the sum of everything sent plus the last residual is the
sum of the true pseudo-gradients (to FP32 rounding). Top-k needs it (SparseLoCo sends 1-3 % of
the entries and still matches DiLoCo); for int8/int4 it is cheap insurance (INTELLECT-1, arXiv
2412.01152; Streaming DiLoCo, arXiv 2501.18512).

The worker's uploader (``worker/uploader.py``) calls it through :class:`ErrorFeedback`, which
keeps the residual between rounds (in one FP32 buffer per key, updated in place) and is part of
the worker's checkpoint. A simulator that wants the exact bits a worker sends calls
:func:`encode_delta` (or :class:`ErrorFeedback`) and sums with the master's
:class:`~diloco_lightning.master.aggregation.RoundSum`, which takes encoded tensors as they are.

Float casts are sent in the plain delta format (``wire/delta/write.py``: a real key's tensor cast to
float32/bfloat16/float16, byte for byte today's files); a complex key stays complex64 under a
16-bit cast (the plain format has no 16-bit complex dtype), so nothing of it is lost.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from diloco_lightning.encoding.codec import decode, encode, encode_with_residual
from diloco_lightning.encoding.format import EncodedTensor, EncodingSpec

__all__ = ["ErrorFeedback", "decode_delta", "encode_delta", "is_lossless"]

_FLOAT32 = EncodingSpec("float32")


def is_lossless(spec: EncodingSpec) -> bool:
    """Whether ``spec`` sends every FP32 value exactly (float32): no residual, ever."""
    return spec.lossless


def _key_spec(t: Tensor, spec: EncodingSpec) -> EncodingSpec:
    # a complex key under a 16-bit cast travels as complex64 (the plain format's only complex dtype)
    return _FLOAT32 if t.is_complex() and spec.cast_dtype is not None else spec


def _as_sent(x: Tensor) -> EncodedTensor:
    """float32 "encoding" of an FP32 tensor without a copy (the tensor itself is the part)."""
    x = x.contiguous()
    return EncodedTensor(_FLOAT32, tuple(x.shape), x.is_complex(), {"q": torch.view_as_real(x) if x.is_complex() else x})


def encode_delta(
    delta: Mapping[str, Tensor],
    spec: EncodingSpec,
    residual: Mapping[str, Tensor | None] | None = None,
    *,
    error_feedback: bool = True,
    in_place: bool = False,
    out: Mapping[str, Tensor] | None = None,
    decay: float = 1.0,
) -> tuple[dict[str, EncodedTensor], dict[str, Tensor] | None]:
    """``(encoded, new residual)``: what a worker sends for the pseudo-gradient ``delta``.

    ``x = delta + fl(decay * residual)`` per key (``residual`` None: zero), then ``encoded[k] =
    encode(x[k], spec)`` and, with ``error_feedback``, ``new_residual[k] = x[k] -
    decode(encoded[k])`` exactly (FP32; complex64 for complex keys). The new residual is None
    when ``error_feedback`` is off or ``spec`` is float32 (it would be all zeros). ``decay`` is
    SparseLoCo's beta (``e = beta * e + delta``; 1: ``x = delta + residual``, bit for bit).

    Args:
        delta: key -> FP32 (complex64) pseudo-gradient, CPU or CUDA (the same bits either way).
        spec: the run's encoding.
        residual: the previous round's residual (every key of ``delta``, same shapes; a value
            None: that key owes nothing), or None.
        error_feedback: compute the new residual.
        in_place: write ``x`` into ``delta``'s tensors and the new residual into ``residual``'s
            (no FP32 allocation per round: a worker's kept buffers). ``delta`` then holds what
            was encoded, so a failed upload can be sent again later without the residual.
        out: contiguous buffers (keys of ``delta``, same shapes and dtypes) to write the new
            residual into, instead of ``residual``'s tensors (``in_place``) or new ones.
        decay: the factor on the residual, in ``(0, 1]``.

    Raises:
        ValueError: a key of ``residual`` missing or of another shape, a tensor that is not
            FP32/complex64, or a NaN/inf value (check first when ``in_place``: the residual may
            then be partly overwritten).
    """
    if not isinstance(spec, EncodingSpec):
        raise ValueError(f"spec must be an EncodingSpec, got {spec!r}")
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
        raise ValueError(f"decay must be a number in (0, 1], got {decay!r}")
    feedback = bool(error_feedback) and not is_lossless(spec)
    encoded: dict[str, EncodedTensor] = {}
    new: dict[str, Tensor] | None = {} if feedback else None
    for k, d in delta.items():
        if not isinstance(d, Tensor) or d.dtype not in (torch.float32, torch.complex64):
            raise ValueError(f"delta[{k!r}] must be a float32 (complex64) tensor, got {getattr(d, 'dtype', type(d))}")
        if residual is not None and k not in residual:
            raise ValueError(f"residual has no {k!r}: give every key of the delta (None: nothing owed)")
        r = None if residual is None else residual[k]
        if r is not None and (not isinstance(r, Tensor) or r.shape != d.shape or r.dtype != d.dtype):
            raise ValueError(f"residual[{k!r}] must be a {d.dtype} tensor of shape {list(d.shape)}")
        ks = _key_spec(d, spec)
        rr = None if r is None else r if decay == 1.0 else r * decay  # two roundings, no FMA: the same bits everywhere
        # in place, with a residual to renew: the encoder adds rr into d in its own pass (same bits)
        fused = rr is not None and in_place and new is not None and not is_lossless(ks) and rr.is_contiguous()
        x = d if rr is None or fused else d.add_(rr) if in_place else d + rr
        buf = out.get(k) if out is not None else (r if in_place and r is not None and r.is_contiguous() else None)
        if is_lossless(ks):  # float32: the tensor itself; its residual is 0
            encoded[k] = _as_sent(x)
            if new is not None:
                new[k] = buf.zero_() if buf is not None else torch.zeros_like(x)
        elif new is not None:
            encoded[k], new[k] = encode_with_residual(x, ks, out=buf, add=rr if fused else None)
        else:
            encoded[k] = encode(x, ks)
    return encoded, new


def decode_delta(encoded: Mapping[str, EncodedTensor | Tensor]) -> dict[str, Tensor]:
    """The FP32 (complex64) pseudo-gradient that ``encoded`` stands for (plain tensors widened)."""
    out: dict[str, Tensor] = {}
    for k, e in encoded.items():
        if isinstance(e, EncodedTensor):
            out[k] = decode(e)
        else:
            out[k] = e if e.is_complex() or e.dtype == torch.float32 else e.float()
    return out


class ErrorFeedback:
    """The worker's error-feedback state: :func:`encode_delta` with the residual kept between rounds.

    The residual is kept per key, in one FP32 buffer each, allocated at the first lossy round of the
    key and updated in place after (``encode(in_place=True)``). A delta may carry some keys only (a
    Streaming DiLoCo fragment): it adds and renews the residual of its own keys, the others' stay
    owed to their own next delta, so each fragment keeps its own residual. :meth:`forget` empties
    keys (their content went back into a delta that will be sent again), :meth:`absorb` adds the
    residual of a delta that was sent after all (an upload that landed although it reported a
    failure). ``state_dict()`` holds the owed residuals (None when nothing is owed) for a checkpoint.

    Args:
        spec: the run's encoding.
        enabled: error feedback on (a residual is kept) or off (every round stands alone).
        decay: SparseLoCo's beta: each delta carries ``delta + decay * residual`` (1: all of it).
    """

    def __init__(self, spec: EncodingSpec, enabled: bool = True, decay: float = 1.0) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be a number in (0, 1], got {decay!r}")
        self.spec = spec
        self.enabled = bool(enabled) and not is_lossless(spec)
        self.decay = float(decay)
        self._buf: dict[str, Tensor] = {}  # key -> its buffer (its content is owed only if the key is in _owed)
        self._owed: set[str] = set()

    @property
    def residual(self) -> dict[str, Tensor] | None:
        """The residual owed to the next deltas, by key (None: nothing). The tensors are the live buffers."""
        return {k: self._buf[k] for k in sorted(self._owed)} if self._owed else None

    def encode(self, delta: Mapping[str, Tensor], *, in_place: bool = False) -> dict[str, EncodedTensor]:
        """Encode ``delta + decay * residual`` (see :func:`encode_delta`) and keep the new residual of
        ``delta``'s keys. A residual carried from a checkpoint is added even when feedback is now off
        (then dropped)."""
        owed = {k: (self._buf[k] if k in self._owed else None) for k in delta}
        if self.decay != 1.0:  # the buffers are ours and about to be renewed: decayed where they are
            for r in owed.values():
                if r is not None:
                    r.mul_(self.decay)
        out = None
        if self.enabled and in_place:  # the kept buffers receive the new residual (a stale one is written, never read)
            out = {k: b for k, b in ((k, self._buf.get(k)) for k in delta)
                   if b is not None and b.shape == delta[k].shape and b.dtype == delta[k].dtype}
        encoded, new = encode_delta(delta, self.spec, owed if self._owed else None, error_feedback=self.enabled,
                                    in_place=in_place, out=out)
        if new is not None:
            self._buf.update(new)
            self._owed.update(new)
        else:
            self._owed.difference_update(delta)
        return encoded

    def state_without(self, keys: Iterable[str]) -> dict[str, Any]:
        """:meth:`state_dict` with copies of the buffers and ``keys`` owing nothing (their residual
        travels in a delta that is kept to be sent again, e.g. a checkpoint's doubtful upload)."""
        drop = set(keys)
        owed = {k: self._buf[k].clone() for k in sorted(self._owed) if k not in drop}
        return {"residual": owed or None}

    def forget(self, keys: Iterable[str] | None = None) -> None:
        """The residual of ``keys`` (None: all) went back into a pseudo-gradient that will be sent
        again: nothing is owed for them now."""
        if keys is None:
            self._owed.clear()
        else:
            self._owed.difference_update(keys)

    def absorb(self, sent: Mapping[str, Tensor]) -> None:
        """``sent`` (an FP32 delta, ``x`` of an earlier round) was delivered after all: add what its
        encoding dropped to the residual of its keys (the encoding is deterministic, so this is
        that round's)."""
        if not self.enabled:
            return
        _, dropped = encode_delta(sent, self.spec, None, error_feedback=True)
        if dropped is None:
            return
        for k, t in dropped.items():
            if k in self._owed:
                self._buf[k].add_(t)
            else:
                self._buf[k] = t
                self._owed.add(k)

    def state_dict(self) -> dict[str, Any]:
        """``{"residual": {key: tensor} | None}`` (the live buffers: copy them if training goes on
        while the checkpoint is written)."""
        return {"residual": self.residual}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        owed = (state or {}).get("residual")
        self._owed.clear()
        if owed is None:
            return
        for k, v in owed.items():
            self._buf[k] = v.detach().to("cpu", torch.complex64 if v.is_complex() else torch.float32).contiguous()
            self._owed.add(k)
