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

from diloco_lightning.encoding.base import Encoding, SpecFields
from diloco_lightning.encoding.blockwise import Int4, Int8
from diloco_lightning.encoding.cast import BFloat16, Float16, Float32
from diloco_lightning.encoding.ctopk import ChunkedTopK
from diloco_lightning.encoding.topk import TopK
from diloco_lightning.util.registry import Registry

__all__ = ["ENCODING_CLASSES", "Encoding", "encoding_class", "encoding_for", "encoding_names", "register_encoding",
           "unregister_encoding"]

_REGISTRY = Registry("encoding", Encoding, (Float32, BFloat16, Float16, Int8, Int4, TopK, ChunkedTopK))
#: name -> class (read-only view; :func:`register_encoding` adds to it)
ENCODING_CLASSES = _REGISTRY.classes
#: make a class (an :class:`Encoding` subclass with a name) the encoding of its name; returns it
register_encoding = _REGISTRY.register
#: forget the encoding of a name (a test's or a plugin's); ``ValueError`` on an unknown name
unregister_encoding = _REGISTRY.unregister


def encoding_names() -> tuple[str, ...]:
    """The registered names, the built-in ones first."""
    return tuple(ENCODING_CLASSES)


def encoding_class(name: str) -> type[Encoding]:
    """The class registered as ``name``; ``ValueError`` listing the valid names otherwise."""
    cls = ENCODING_CLASSES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"name must be one of {list(ENCODING_CLASSES)}, got {name!r}")
    return cls


def encoding_for(spec: SpecFields) -> Encoding:
    """The codec of ``spec``: its encoding's class bound to it."""
    return encoding_class(spec.name)(spec)
