"""diloco_lightning: asynchronous, staleness-aware DiLoCo for Lightning and Accelerate.

The layers, each importing only those below it: ``util`` -> ``encoding``, ``wire`` (the formats
on a hub) -> ``hub`` (the transports) -> ``outer``, ``master``, ``worker``, ``sim`` -> ``adapters``
(Lightning, Accelerate) -> ``app`` (the Hydra product). Everything below ``adapters`` is framework-free.
``diloco_lightning.DiLoCo`` (the Lightning callback) is imported lazily so that a
master process never pays for ``import lightning``.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["DiLoCo", "__version__"]


def __getattr__(name: str):
    if name == "DiLoCo":
        from diloco_lightning.adapters.lightning import DiLoCo

        return DiLoCo
    raise AttributeError(f"module 'diloco_lightning' has no attribute {name!r}")
