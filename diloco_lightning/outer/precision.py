"""The precision of the outer optimizers' buffers: FP32 or bf16, rounded to nearest or stochastically.

The math of every outer optimizer runs in FP32 (complex64 for complex keys: :func:`math_dtype`);
``state_dtype="bfloat16"`` keeps the buffers of real keys in bf16, read into FP32 for each step
and rounded back once, to nearest even or, with ``stochastic_rounding``, by
:func:`stochastic_round_` (see :mod:`diloco_lightning.outer.base` for the contract).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["STATE_DTYPES", "math_dtype", "parse_state_dtype", "stochastic_round_"]


def math_dtype(is_complex: bool) -> torch.dtype:
    """The dtype the math runs in: complex64 for a complex tensor, else FP32."""
    return torch.complex64 if is_complex else torch.float32


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
