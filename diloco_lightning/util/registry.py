"""A registry of classes by name: how the library is extended by one file and one registration.

The encodings (``encoding/registry.py``) and the outer optimizers (``outer/__init__.py``) each keep
one :class:`Registry`: a class declares its ``name`` (and its capabilities, which callers ask), one
:meth:`Registry.register` makes it usable everywhere; a test or a plugin may :meth:`Registry.unregister`
it again. Looking a name up, and the error that lists the valid names, stay with each registry's owner.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Generic, TypeVar

__all__ = ["Registry"]

logger = logging.getLogger(__name__)

C = TypeVar("C")


class Registry(Generic[C]):
    """Name -> class, for subclasses of ``base`` that set a ``name``.

    Args:
        kind: what a class is, for messages (``"encoding"``, ``"outer optimizer"``).
        base: the class every registered one subclasses.
        classes: the built-in ones, in the order names are listed.
    """

    def __init__(self, kind: str, base: type[C], classes: Iterable[type[C]] = ()) -> None:
        self.kind, self.base = kind, base
        self._classes: dict[str, type[C]] = {}
        #: name -> class (a read-only view; it follows :meth:`register` and :meth:`unregister`)
        self.classes: Mapping[str, type[C]] = MappingProxyType(self._classes)
        for cls in classes:
            self.register(cls)

    def register(self, cls: type[C]) -> type[C]:
        """Make ``cls`` the one named ``cls.name`` (usable as a class decorator); returns ``cls``.

        Raises:
            ValueError: ``cls`` is not a subclass of ``base`` with a name, or another class has the name.
        """
        name = getattr(cls, "name", None) if isinstance(cls, type) and issubclass(cls, self.base) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"a registered {self.kind} is a subclass of {self.base.__name__} with a name, got {cls!r}")
        taken = self._classes.get(name)
        if taken is not None and taken is not cls:
            raise ValueError(f"{self.kind} {name!r} is already registered ({taken.__qualname__})")
        self._classes[name] = cls
        logger.debug("%s %r registered: %s", self.kind, name, cls.__qualname__)
        return cls

    def unregister(self, name: str) -> None:
        """Forget the class named ``name``; ``ValueError`` listing the names if there is none."""
        if name not in self._classes:
            raise ValueError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self._classes)}")
        del self._classes[name]
