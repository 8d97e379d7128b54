"""Optional HMAC-SHA256 signatures of delta files with a shared run key.

The run key is never written to configs or logs. It comes from, in order:
``DILOCO_RUN_KEY`` (the key text, UTF-8) or ``DILOCO_RUN_KEY_FILE`` (a file whose
bytes, minus one trailing newline, are the key).

What is signed (``diloco-sig/1``), byte for byte::

    b"diloco-sig/1\\n"
    + canonical JSON of the header without "signature": every other metadata entry of the
      file, exactly as stored (all strings), as Python's
      json.dumps(header, sort_keys=True, separators=(",", ":")) writes it (ASCII, non-ASCII
      characters escaped as \\uXXXX)
    + b"\\n"
    + for each tensor in sorted name order:
        name (UTF-8) + b"\\0" + dtype (e.g. "float32") + b"\\0" + shape ("4,3"; "" for 0-d) + b"\\0"
        + the tensor's raw little-endian bytes in C order

The ``signature`` header value is the lowercase hex HMAC-SHA256 of that message. The
byte lengths follow from dtype and shape, so the message is unambiguous. A verifier
recomputes it from the file's own metadata and tensors (not from a re-serialised header),
so any added, removed or changed header entry or tensor byte breaks the signature.
Because the header (node_id, local_step, base_outer_step, num_tokens, fingerprint)
is inside the message, a signed delta cannot be replayed under another identity.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from pathlib import Path
from typing import Mapping

import torch

SIGNATURE_SCHEME = "diloco-sig/1"
ENV_KEY = "DILOCO_RUN_KEY"
ENV_KEY_FILE = "DILOCO_RUN_KEY_FILE"
_HEX64 = re.compile(r"[0-9a-f]{64}")


class RunKey:
    """A shared secret; its repr never shows the key."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes | str) -> None:
        if isinstance(key, str):
            key = key.encode("utf-8")
        if not isinstance(key, (bytes, bytearray)) or len(key) == 0:
            raise ValueError("run key must be non-empty bytes or text")
        self._key = bytes(key)

    @property
    def key(self) -> bytes:
        return self._key

    def __repr__(self) -> str:
        return "RunKey(<hidden>)"

    __str__ = __repr__

    def sign(self, metadata: Mapping[str, str], tensors: Mapping[str, torch.Tensor]) -> str:
        """Hex HMAC-SHA256 of ``metadata`` (without ``signature``) and ``tensors``."""
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        _update_message(mac, metadata, tensors)
        return mac.hexdigest()

    def verify(self, signature: object, metadata: Mapping[str, str], tensors: Mapping[str, torch.Tensor]) -> bool:
        """True iff ``signature`` is the HMAC of ``metadata`` (its ``signature`` entry ignored) and ``tensors``.

        A malformed signature (not 64 lowercase hex digits) is simply ``False``.
        """
        if not isinstance(signature, str) or _HEX64.fullmatch(signature) is None:
            return False
        return hmac.compare_digest(self.sign(metadata, tensors).encode("ascii"), signature.encode("ascii"))


def _update_message(mac, metadata: Mapping[str, str], tensors: Mapping[str, torch.Tensor]) -> None:
    header = {k: v for k, v in metadata.items() if k != "signature"}
    mac.update(SIGNATURE_SCHEME.encode() + b"\n")
    mac.update(json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8"))
    mac.update(b"\n")
    for name in sorted(tensors):
        t = tensors[name].detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        shape = ",".join(str(d) for d in t.shape)
        mac.update(name.encode("utf-8") + b"\0" + dtype.encode() + b"\0" + shape.encode() + b"\0")
        if t.numel():
            mac.update(t.reshape(-1).view(torch.uint8).numpy())


def load_run_key(key: bytes | str | RunKey | None = None, key_file: str | os.PathLike | None = None) -> RunKey | None:
    """The run key from an explicit value, a file, or the environment; None when the run is unsigned."""
    if isinstance(key, RunKey):
        return key
    if key is not None:
        return RunKey(key)
    if key_file is None:
        env_key = os.environ.get(ENV_KEY)
        if env_key:
            return RunKey(env_key)
        key_file = os.environ.get(ENV_KEY_FILE) or None
    if key_file is None:
        return None
    try:
        data = Path(key_file).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the run key file {key_file}: {e.strerror or e}") from None
    if data.endswith(b"\n"):
        data = data[:-1]
    if not data:
        raise ValueError(f"run key file {key_file} is empty")
    return RunKey(data)
