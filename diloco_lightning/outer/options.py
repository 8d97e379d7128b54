"""An outer optimizer chosen by name, its learning rate and its other options, checked once.

:func:`outer_options` is what the master's configuration (``MasterConfig.outer_*``, the ``outer``
group of both commands) turns into ``build_outer_optimizer(name, state, **options)``'s keywords:
the name must be registered, ``lr`` a positive number, the buffers' precision a known one, and an
option the named optimizer does not take is dropped with a warning (so ``outer.name=X`` works on
top of another optimizer's options). Errors are :class:`~diloco_lightning.util.options.OptionError`
naming ``name``, ``lr``, ``options``, ``state_dtype`` or ``stochastic_rounding``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from diloco_lightning.util.options import OptionError

__all__ = ["outer_options"]

log = logging.getLogger(__name__)


def outer_options(name: Any, lr: Any, options: Any, *, state_dtype: Any = "float32", stochastic_rounding: Any = False,
                  where: str = "") -> dict[str, Any]:
    """``{"lr": lr, **options}`` for the optimizer ``name`` (see the module docstring); ``where``
    prefixes the option names in the warning about dropped ones (``"outer."``)."""
    # what needs no optimizer class first: a bad lr is refused before torch is imported (the CLI's start-up)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or not lr > 0:
        raise OptionError("lr", f"must be a number > 0, got {lr}")
    if not isinstance(options, Mapping):
        raise OptionError("options", "must be a mapping")
    from diloco_lightning.outer import OUTER_OPTIMIZERS, outer_optimizer_options
    from diloco_lightning.outer.precision import STATE_DTYPES

    if name not in OUTER_OPTIMIZERS:
        raise OptionError("name", f"unknown outer optimizer {name!r}; valid: {', '.join(sorted(OUTER_OPTIMIZERS))}",
                          f"unknown outer optimizer {name!r}; valid: {', '.join(sorted(OUTER_OPTIMIZERS))}")
    state_dtype = str(state_dtype)
    if state_dtype not in STATE_DTYPES:
        raise OptionError("state_dtype", f"must be float32 (fp32), bfloat16 (bf16) or int8, got {state_dtype!r}")
    if stochastic_rounding and STATE_DTYPES[state_dtype] != STATE_DTYPES["bfloat16"]:
        raise OptionError("stochastic_rounding", f"needs {where}state_dtype=bfloat16 (FP32 and 8-bit buffers are not "
                          "rounded stochastically)")
    opts: dict[str, Any] = {str(k): v for k, v in options.items()}
    opts["lr"] = float(lr)
    # the buffers' precision: recorded only when not the default (a published run's options stay as they were)
    if state_dtype not in ("float32", "fp32"):
        opts["state_dtype"] = state_dtype
    if stochastic_rounding:
        opts["stochastic_rounding"] = True
    accepted = outer_optimizer_options(str(name))
    dropped = sorted(k for k in opts if k not in accepted)
    if dropped:
        log.warning("outer optimizer %r takes no option(s) %s; ignoring %s", name, dropped,
                    ", ".join(f"{where}options.{k}" for k in dropped))
        opts = {k: v for k, v in opts.items() if k in accepted}
    if isinstance(opts.get("betas"), list):
        opts["betas"] = tuple(opts["betas"])
    return opts
