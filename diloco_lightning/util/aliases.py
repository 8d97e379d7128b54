"""Old import paths that keep working: ``import diloco_lightning.deltafile`` is the new module itself.

The flat modules of the first layout moved into the layer folders (``util``, ``wire``, ``encoding``,
``hub``, ``adapters``). A user's ``from diloco_lightning.accelerate import DiLoCo`` or
``import diloco_lightning.deltafile`` still works: a finder on ``sys.meta_path`` answers each old
name with the module it moved to (the same object, so ``isinstance`` checks and monkeypatching
see one module). Nothing in the package imports an old name (``tests/test_layers.py``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

#: old module name -> the module it is now
MOVED = {
    "diloco_lightning.fileio": "diloco_lightning.util.fileio",
    "diloco_lightning.faults": "diloco_lightning.util.faults",
    "diloco_lightning.waiting": "diloco_lightning.util.waiting",
    "diloco_lightning.options": "diloco_lightning.util.options",
    "diloco_lightning.names": "diloco_lightning.wire.names",
    "diloco_lightning.stheader": "diloco_lightning.wire.layout",
    "diloco_lightning.statefile": "diloco_lightning.wire.statefile",
    "diloco_lightning.manifest": "diloco_lightning.wire.manifest",
    "diloco_lightning.signing": "diloco_lightning.wire.signing",
    "diloco_lightning.nodeclaim": "diloco_lightning.wire.claims",
    "diloco_lightning.fragments": "diloco_lightning.wire.fragments",
    "diloco_lightning.deltafile": "diloco_lightning.wire.delta",
    "diloco_lightning.deltaformat": "diloco_lightning.wire.delta.header",
    "diloco_lightning.deltaread": "diloco_lightning.wire.delta.read",
    "diloco_lightning.encoding_format": "diloco_lightning.encoding.format",
    "diloco_lightning.encoding_kernels": "diloco_lightning.encoding.kernels",
    "diloco_lightning.compression": "diloco_lightning.encoding.feedback",
    "diloco_lightning.globals": "diloco_lightning.hub.versions",
    "diloco_lightning.callback": "diloco_lightning.adapters.lightning",
    "diloco_lightning.accelerate": "diloco_lightning.adapters.accelerate",
    "diloco_lightning.worker.adapter": "diloco_lightning.adapters.shared",
    "diloco_lightning.lit_module": "diloco_lightning.models.lit_module",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        # the module it moved to, unchanged: the import system keeps its __name__ and __spec__
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> None:
    """Answer the old names (idempotent)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())  # before any path finder: an old file left in a checkout never wins
