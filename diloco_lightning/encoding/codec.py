"""Pseudo-gradient encodings: plain casts, blockwise int8/int4 and top-k, bit-exact on any device.

A worker's pseudo-gradient (``anchor - local``; DiLoCo, Douillard et al. 2023, arXiv 2311.08105)
is what travels through the hub, so its size is the run's bandwidth. The field has shown that it
survives heavy compression: int8 with FP32 accumulation (INTELLECT-1, arXiv 2412.01152), 4 bits
(Streaming DiLoCo, arXiv 2501.18512), top-k at 1-3 % density with error feedback (SparseLoCo).

The encodings (``float32``/``bfloat16``/``float16`` casts, blockwise ``int8``/``int4``, ``topk``,
the chunked top-k ``ctopk``) are one class each (:mod:`diloco_lightning.encoding.registry`), which
encodes and decodes one flat tensor; their parts' layout and the checks of an untrusted file are in
:mod:`diloco_lightning.encoding.format` (:class:`EncodingSpec`, :class:`EncodedTensor`,
:func:`expected_parts`, :func:`validate_parts`). This module encodes and decodes whole tensors through
them; ``diloco_lightning.encoding`` exports the public names of the three.

:func:`encode` returns an :class:`EncodedTensor`, the same bits on CPU and CUDA, contiguous or not.
A complex tensor is encoded as its real view (``torch.view_as_real``).

:func:`decode_add_` adds ``alpha * decode(x)`` into an FP32 sum in chunks of :data:`CHUNK`
values, so a master summing deltas never holds a full-size decoded copy. For error feedback,
:func:`encode_with_residual` also returns ``x - decode(encode(x))`` from the same pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor

from diloco_lightning.encoding.format import EncodedTensor, EncodingSpec, real_view_shape
from diloco_lightning.encoding.registry import encoding_for


# ----------------------------------------------------------------------------- encode / decode


def _flat_real(t: Tensor) -> tuple[Tensor, bool]:
    if not isinstance(t, Tensor) or not (t.is_floating_point() or t.is_complex()):
        raise ValueError(f"t must be a floating point or complex tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    real = torch.view_as_real(t) if t.is_complex() else t
    return real.detach().reshape(-1).contiguous(), t.is_complex()  # copies only a non-contiguous tensor


def _encode(t: Tensor, spec: EncodingSpec, with_residual: bool, out: Tensor | None = None,
            add: Tensor | None = None) -> tuple[EncodedTensor, Tensor | None]:
    if not isinstance(spec, EncodingSpec):
        raise ValueError(f"spec must be an EncodingSpec, got {spec!r}")
    flat, is_complex = _flat_real(t)
    coder = encoding_for(spec)
    addf = None
    if add is not None:
        if (not isinstance(add, Tensor) or add.dtype != t.dtype or add.shape != t.shape or not add.is_contiguous()
                or add.device != t.device or t.dtype not in (torch.float32, torch.complex64)):
            raise ValueError(f"add must be a contiguous tensor of t's dtype, shape and device (t: a float32 or "
                             f"complex64 tensor), got {getattr(add, 'dtype', type(add).__name__)}")
        addf = (torch.view_as_real(add) if is_complex else add).view(-1)
        real = torch.view_as_real(t) if is_complex else t
        if flat.data_ptr() != real.data_ptr() or not coder.adds_in_pass:
            flat.add_(addf)  # a copy of a non-contiguous t, or a selection that needs all of x first
            if flat.data_ptr() != real.data_ptr():
                real.copy_(flat.view(real.shape))
            addf = None
    shape = tuple(t.shape)
    real_shape = real_view_shape(shape, is_complex)
    res = None
    if with_residual:
        if out is None:
            out = torch.empty(shape, dtype=torch.complex64 if is_complex else torch.float32, device=flat.device)
        elif (not isinstance(out, Tensor) or out.dtype != (torch.complex64 if is_complex else torch.float32)
              or tuple(out.shape) != shape or not out.is_contiguous() or out.device != flat.device):
            raise ValueError(f"out must be a contiguous {'complex64' if is_complex else 'float32'} tensor "
                             f"of shape {list(shape)} on {flat.device}")
        res = (torch.view_as_real(out) if is_complex else out).view(-1)
    parts = coder.encode(flat, real_shape, res, addf)
    return EncodedTensor(spec, shape, is_complex, parts), out


def encode(t: Tensor, spec: EncodingSpec) -> EncodedTensor:
    """Encode a floating point or complex tensor of any shape (see the module docstring).

    Raises:
        ValueError: on a non-floating tensor, or one with NaN or inf values.
    """
    return _encode(t, spec, with_residual=False)[0]


def encode_with_residual(t: Tensor, spec: EncodingSpec, out: Tensor | None = None, *,
                         add: Tensor | None = None) -> tuple[EncodedTensor, Tensor]:
    """``(encode(t), residual)``, ``residual = fp32(t) - decode(encode(t))`` computed in the same pass.

    Error feedback: the worker adds ``residual`` to its next pseudo-gradient, so what an encoding
    drops is sent later instead of lost (the sum of decoded deltas plus the last residual equals
    the sum of the true deltas). ``out``: a contiguous FP32 (complex64) tensor of ``t``'s shape
    and device to write the residual into, ``t`` itself included; a worker that keeps one
    error-feedback buffer this way allocates (and page-faults) nothing per round. When encoding
    fails (NaN or inf values) ``out`` may already be partly overwritten.

    ``add`` (a float32/complex64 ``t`` only): ``t += add`` in place first, then ``t`` is encoded,
    with the same bits as ``t.add_(add)`` before the call. The casts and int8/int4 add chunk by
    chunk in their one pass over ``t``, so the worker's error feedback costs no extra pass; ``add``
    may be ``out`` itself (each chunk is added before its residual is written).
    """
    enc, residual = _encode(t, spec, with_residual=True, out=out, add=add)
    assert residual is not None
    return enc, residual


def _decoded_chunks(enc: EncodedTensor, device: torch.device) -> Iterator[tuple[slice | Tensor, Tensor]]:
    """``(where, values)`` CHUNK values at a time (:meth:`Encoding.chunks`): a slice of the flat tensor
    (dense encodings) or int64 positions (sparse ones), and their decoded FP32 values in a reused
    work buffer."""
    p = {k: t.to(device) for k, t in enc.parts.items()}  # the encoded size, never FP32
    return encoding_for(enc.spec).chunks(p, enc.numel, device)


def _shaped(flat: Tensor, enc: EncodedTensor) -> Tensor:
    out = flat.view(real_view_shape(enc.shape, enc.complex))
    return torch.view_as_complex(out) if enc.complex else out


def decode(enc: EncodedTensor) -> Tensor:
    """The FP32 tensor (complex64 for a complex one) that ``enc`` stands for, on the parts' device."""
    device = enc.parts["q"].device
    new = torch.zeros if encoding_for(enc.spec).sparse else torch.empty
    out = new(enc.numel, dtype=torch.float32, device=device)
    for where, vals in _decoded_chunks(enc, device):
        out[where] = vals
    return _shaped(out, enc)


def decode_add_(out: Tensor, enc: EncodedTensor, alpha: float = 1.0) -> Tensor:
    """``out += alpha * decode(enc)`` in place, in chunks of CHUNK values; returns ``out``.

    ``out`` is a contiguous FP32 tensor of ``enc.shape`` (complex64 for a complex tensor), on any
    device. The result equals ``out + alpha * decode(enc)`` bit for bit (the product is rounded,
    then added), except that top-k leaves the entries it did not keep untouched (``-0.0`` stays).
    Extra memory: one chunk of FP32 (plus a chunk of int64 positions for top-k).
    """
    want = torch.complex64 if enc.complex else torch.float32
    if not isinstance(out, Tensor) or out.dtype != want or tuple(out.shape) != enc.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {want} tensor of shape {list(enc.shape)}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"alpha must be a finite number, got {alpha!r}")
    flat = (torch.view_as_real(out) if enc.complex else out).view(-1)
    for where, vals in _decoded_chunks(enc, out.device):
        if alpha != 1:
            vals.mul_(float(alpha))
        if isinstance(where, slice):
            flat[where].add_(vals)
        else:  # distinct positions: each entry gets one addition, in any order the same bits
            flat.scatter_add_(0, where, vals)
    return out


def sum_of_squares(enc: EncodedTensor) -> float:
    """``||decode(enc)||^2`` (a Python float), from the decoded FP32 values chunk by chunk: no full-size
    copy. Each chunk's norm is FP32 (as ``torch.linalg.vector_norm`` of a plain tensor), the sum FP64."""
    total = 0.0
    for _, vals in _decoded_chunks(enc, enc.parts["q"].device):
        if vals.numel():
            total += float(torch.linalg.vector_norm(vals)) ** 2
    return total
