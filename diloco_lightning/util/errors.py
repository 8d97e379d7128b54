"""The package's one error root and the two families callers catch as one.

Every exception the package raises is a :class:`DiLoCoError`, so ``except DiLoCoError`` sees all
of them. Each family also keeps the builtin base its callers already catch (``ValueError`` for a
bad value, ``RuntimeError`` for a hub or a worker that cannot go on), so code written against the
builtin keeps working.

* :class:`DeltaRejected`: a delta refused, with a stable short ``reason`` and a human ``detail``.
  The reader's file errors (``diloco_lightning.wire.delta.DeltaFileError`` and its kinds) are
  rejections too, so a caller catches one type and reads ``reason`` / ``detail`` from it.
* :class:`ConfigError`: a configuration value or an option out of range, or a configuration that
  does not match the run it joins; ``key`` names what to change.
"""

from __future__ import annotations

__all__ = ["DiLoCoError", "ConfigError", "DeltaRejected"]


class DiLoCoError(Exception):
    """The root of every exception ``diloco_lightning`` defines."""


class ConfigError(DiLoCoError, ValueError):
    """A configuration value a user must change; ``key`` names it (None when the message does),
    ``detail`` says what is wanted. The message is ``"<key>: <detail>"``."""

    def __init__(self, key: str | None, detail: str = "", message: str | None = None) -> None:
        self.key = key
        self.detail = detail
        super().__init__(message if message is not None else (f"{key}: {detail}" if key is not None else detail))


class DeltaRejected(DiLoCoError):
    """A delta that is refused; ``reason`` is a stable short code (the master's metrics count
    rejections by it), ``detail`` the human explanation."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(self._message())

    def _message(self) -> str:
        return f"{self.reason}: {self.detail}"
