"""The precision of the outer optimizers' buffers: FP32, bf16 (to nearest or stochastic), or 8-bit blockwise.

The math of every outer optimizer runs in FP32 (complex64 for complex keys: :func:`math_dtype`);
``state_dtype="bfloat16"`` keeps the buffers of real keys in bf16, read into FP32 for each step
and rounded back once, to nearest even or, with ``stochastic_rounding``, by
:func:`stochastic_round_`; ``state_dtype="int8"`` keeps them as 8-bit blockwise codes
(:mod:`diloco_lightning.outer.blockwise`; the codes are ``torch.uint8`` tensors, their block maxima
FP32). See :mod:`diloco_lightning.outer.base` for the contract.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["STATE_DTYPES", "STATE_DTYPE_NAMES", "math_dtype", "parse_state_dtype", "stochastic_round_"]


def math_dtype(is_complex: bool) -> torch.dtype:
    """The dtype the math runs in: complex64 for a complex tensor, else FP32."""
    return torch.complex64 if is_complex else torch.float32


#: ``state_dtype`` names -> the dtype of the buffers of real keys
STATE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "int8": torch.uint8,  # 8-bit blockwise codes (outer/blockwise.py)
}
#: the name each buffer dtype is recorded under in an optimizer's options
STATE_DTYPE_NAMES: dict[torch.dtype, str] = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.uint8: "int8"}


def parse_state_dtype(value: Any) -> torch.dtype:
    """``"float32"``/``"fp32"``/``"bfloat16"``/``"bf16"``/``"int8"`` (or the torch dtype) -> torch dtype
    (``torch.uint8`` for the 8-bit blockwise codes).

    Raises:
        ValueError: naming ``state_dtype`` for anything else.
    """
    if isinstance(value, torch.dtype) and value in STATE_DTYPES.values():
        return value
    if isinstance(value, str) and value.lower().removeprefix("torch.") in STATE_DTYPES:
        return STATE_DTYPES[value.lower().removeprefix("torch.")]
    raise ValueError(f"state_dtype must be one of 'float32', 'bfloat16', 'int8' (or 'fp32', 'bf16'), got {value!r}")


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
