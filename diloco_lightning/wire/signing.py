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
is inside the message, a signed delta cannot be replayed under another identity. A
worker's offered initial weights (``nodes/<node>/init.safetensors``) are signed the
same way. :meth:`RunKey.verify_file` checks a file's signature by streaming its tensor
bytes from disk in 1 MiB chunks (the message is the same), so a file with a bogus
signature costs no more memory than a chunk, whatever it holds.

Documents the master publishes (``diloco-doc-sig/1``): the manifest
(``global/manifest.json``) and the lease (``global/lease.json``), and a worker's claim on its
node id (``nodes/<node>/claim.json``), carry a ``signature`` entry, the lowercase hex HMAC-SHA256 of::

    b"diloco-doc-sig/1\n" + kind (b"manifest", b"lease" or b"claim") + b"\n"
    + json.dumps(document without "signature", sort_keys=True, separators=(",", ":"),
                 allow_nan=False) as UTF-8

The manifest names the weights and the optimizer state by SHA-256 (current version and
every kept older one), so its signature authenticates the whole published version:
weights, optimizer state, ledger, history and master. A reader holding the run key
refuses a document whose signature is missing or wrong.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from diloco_lightning.wire.layout import TORCH_DTYPE_NAMES, Layout, iter_tensor_bytes
from diloco_lightning.util.fileio import open_regular

SIGNATURE_SCHEME = "diloco-sig/1"
DOCUMENT_SCHEME = "diloco-doc-sig/1"
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
        mac = self.start_message(metadata)
        for name in sorted(tensors):
            self.add_tensor(mac, name, tensors[name])
        return mac.hexdigest()

    # the message built piece by piece (a reader hashes each tensor as it reads it)

    def start_message(self, metadata: Mapping[str, str]):
        """An HMAC holding the message's header part; feed tensors in sorted name order."""
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        _update_header(mac, metadata)
        return mac

    @staticmethod
    def add_tensor(mac, name: str, t: torch.Tensor) -> None:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        shape = ",".join(str(d) for d in t.shape)
        mac.update(name.encode("utf-8") + b"\0" + dtype.encode() + b"\0" + shape.encode() + b"\0")
        if t.numel():
            mac.update(t.reshape(-1).view(torch.uint8).numpy())

    @staticmethod
    def finish_verify(mac, signature: object) -> bool:
        if not isinstance(signature, str) or _HEX64.fullmatch(signature) is None:
            return False
        return hmac.compare_digest(mac.hexdigest().encode("ascii"), signature.encode("ascii"))

    def verify(self, signature: object, metadata: Mapping[str, str], tensors: Mapping[str, torch.Tensor]) -> bool:
        """True iff ``signature`` is the HMAC of ``metadata`` (its ``signature`` entry ignored) and ``tensors``.

        A malformed signature (not 64 lowercase hex digits) is simply ``False``.
        """
        if not isinstance(signature, str) or _HEX64.fullmatch(signature) is None:
            return False
        return hmac.compare_digest(self.sign(metadata, tensors).encode("ascii"), signature.encode("ascii"))

    def verify_file(self, signature: object, path: str | os.PathLike, layout: Layout) -> bool:
        """:meth:`verify` for a file on disk whose ``layout`` was read (and checked) by
        :func:`diloco_lightning.wire.layout.read_layout`: the tensor bytes are streamed, never loaded."""
        if not isinstance(signature, str) or _HEX64.fullmatch(signature) is None:
            return False
        mac = self.start_message(layout.metadata)
        with open_regular(path) as f:  # a held hub file: the one whose layout was read
            for name in sorted(layout.tensors):
                info = layout.tensors[name]
                shape = ",".join(str(d) for d in info.shape)
                mac.update(name.encode("utf-8") + b"\0" + TORCH_DTYPE_NAMES[info.dtype].encode() + b"\0" + shape.encode() + b"\0")
                for chunk in iter_tensor_bytes(f, info):
                    mac.update(chunk)
        return self.finish_verify(mac, signature)

    def sign_document(self, kind: str, doc: Mapping[str, Any]) -> str:
        """Hex HMAC-SHA256 of a JSON document (its ``signature`` entry left out); see the module docstring."""
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        body = {k: v for k, v in doc.items() if k != "signature"}
        mac.update(DOCUMENT_SCHEME.encode() + b"\n" + kind.encode() + b"\n")
        mac.update(json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8"))
        return mac.hexdigest()

    def verify_document(self, kind: str, doc: Mapping[str, Any]) -> bool:
        """True iff ``doc["signature"]`` is :meth:`sign_document` of ``doc``."""
        signature = doc.get("signature")
        if not isinstance(signature, str) or _HEX64.fullmatch(signature) is None:
            return False
        try:
            want = self.sign_document(kind, doc)
        except (TypeError, ValueError):
            return False
        return hmac.compare_digest(want.encode("ascii"), signature.encode("ascii"))


def _update_header(mac, metadata: Mapping[str, str]) -> None:
    header = {k: v for k, v in metadata.items() if k != "signature"}
    mac.update(SIGNATURE_SCHEME.encode() + b"\n")
    mac.update(json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8"))
    mac.update(b"\n")


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
