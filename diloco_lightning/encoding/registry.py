"""The encodings by name: one class each (:class:`~diloco_lightning.encoding.base.Encoding`), registered.

=============  =======================================================  ==============================
name           class                                                    capabilities
=============  =======================================================  ==============================
``float32``    :class:`~diloco_lightning.encoding.cast.Float32`         cast, lossless
``bfloat16``   :class:`~diloco_lightning.encoding.cast.BFloat16`        cast
``float16``    :class:`~diloco_lightning.encoding.cast.Float16`         cast
``int8``       :class:`~diloco_lightning.encoding.blockwise.Int8`       quantized, error feedback
``int4``       :class:`~diloco_lightning.encoding.blockwise.Int4`       quantized, error feedback
``topk``       :class:`~diloco_lightning.encoding.topk.TopK`            sparse, error feedback
``ctopk``      :class:`~diloco_lightning.encoding.ctopk.ChunkedTopK`    sparse, error feedback
=============  =======================================================  ==============================

A new encoding is one file (a subclass of :class:`Encoding`) and one :func:`register_encoding`; the
spec, the codec, the worker's error feedback and the delta files ask its capabilities. Needs no
torch (the classes import their kernels on first use).
"""

from __future__ import annotations

import logging
from types import MappingProxyType

from diloco_lightning.encoding.base import Encoding, EncodingSpec
from diloco_lightning.encoding.blockwise import Int4, Int8
from diloco_lightning.encoding.cast import BFloat16, Float16, Float32
from diloco_lightning.encoding.ctopk import ChunkedTopK
from diloco_lightning.encoding.topk import TopK

__all__ = ["ENCODING_CLASSES", "Encoding", "encoding_class", "encoding_for", "encoding_names", "register_encoding",
           "unregister_encoding"]

logger = logging.getLogger(__name__)

_REGISTRY: dict[str, type[Encoding]] = {cls.name: cls for cls in (Float32, BFloat16, Float16, Int8, Int4, TopK, ChunkedTopK)}
#: name -> class (read-only view; :func:`register_encoding` adds to it)
ENCODING_CLASSES = MappingProxyType(_REGISTRY)


def register_encoding(cls: type[Encoding]) -> type[Encoding]:
    """Make ``cls`` the encoding named ``cls.name`` (usable as a class decorator); returns ``cls``.

    Raises:
        ValueError: ``cls`` is not an :class:`Encoding` subclass with a name, or the name is taken.
    """
    if not (isinstance(cls, type) and issubclass(cls, Encoding)) or not isinstance(cls.name, str) or not cls.name:
        raise ValueError(f"an encoding is an Encoding subclass with a name, got {cls!r}")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"encoding {cls.name!r} is already registered ({_REGISTRY[cls.name].__qualname__})")
    _REGISTRY[cls.name] = cls
    logger.debug("encoding %r registered: %s", cls.name, cls.__qualname__)
    return cls


def unregister_encoding(name: str) -> None:
    """Forget the encoding ``name`` (a test's or a plugin's); ``ValueError`` on an unknown name."""
    encoding_class(name)
    del _REGISTRY[name]


def encoding_names() -> tuple[str, ...]:
    """The registered names, the built-in ones first."""
    return tuple(_REGISTRY)


def encoding_class(name: str) -> type[Encoding]:
    """The class registered as ``name``; ``ValueError`` listing the valid names otherwise."""
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"name must be one of {list(_REGISTRY)}, got {name!r}")
    return cls


def encoding_for(spec: EncodingSpec) -> Encoding:
    """The codec of ``spec``: its encoding's class bound to it."""
    return encoding_class(spec.name)(spec)
