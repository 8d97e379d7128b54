"""One error root: every exception the package defines is a ``DiLoCoError``; a delta file error is
a ``DeltaRejected`` with ``reason`` and ``detail``; the configuration errors are one family; and
each class keeps the builtin base its callers catch."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import diloco_lightning
from diloco_lightning.util.errors import ConfigError, DeltaRejected, DiLoCoError

#: exceptions that are deliberately not ``Exception``s: they must pass ``except Exception``
NOT_ERRORS = {
    # SIGTERM raised in the main thread, like KeyboardInterrupt for Ctrl-C
    "diloco_lightning.app.errors.Signal",
}


def _package_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(diloco_lightning.__path__, "diloco_lightning."):
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == info.name:
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_exception_class_of_the_package_derives_from_diloco_error():
    found = _package_exceptions()
    assert len(found) > 40  # the walk saw the package
    outside = sorted(name for name, cls in found.items() if not issubclass(cls, DiLoCoError) and name not in NOT_ERRORS)
    assert not outside, f"exception classes outside the DiLoCoError root: {outside}"
    for name in NOT_ERRORS:
        assert name in found and not issubclass(found[name], Exception), name


@pytest.mark.parametrize("name, builtin", [
    ("diloco_lightning.hub.base.HubError", RuntimeError),
    ("diloco_lightning.worker.sync.WorkerError", RuntimeError),
    ("diloco_lightning.worker.sync.WaitTimeoutError", TimeoutError),
    ("diloco_lightning.app.resources.ResourceError", RuntimeError),
    ("diloco_lightning.app.errors.RunError", RuntimeError),
    ("diloco_lightning.wire.delta.header.DeltaFileError", ValueError),
    ("diloco_lightning.wire.names.InvalidNameError", ValueError),
    ("diloco_lightning.wire.manifest.ManifestError", ValueError),
    ("diloco_lightning.wire.statefile.StateFileError", ValueError),
    ("diloco_lightning.wire.layout.LayoutError", ValueError),
    ("diloco_lightning.wire.claims.ClaimError", ValueError),
    ("diloco_lightning.wire.fragments.FragmentError", ValueError),
    ("diloco_lightning.encoding.format.EncodingError", ValueError),
    ("diloco_lightning.master.aggregation.NonFiniteAggregate", ValueError),
    ("diloco_lightning.util.options.OptionError", ValueError),
    ("diloco_lightning.master.config.MasterConfigError", ValueError),
    ("diloco_lightning.app.checks.ConfigError", ValueError),
])
def test_each_error_keeps_the_builtin_base_its_callers_catch(name, builtin):
    module, _, cls = name.rpartition(".")
    assert issubclass(getattr(importlib.import_module(module), cls), builtin)


def test_a_delta_file_error_is_a_rejection_with_reason_and_detail():
    from diloco_lightning.master.validation import DeltaRejected as FromValidation
    from diloco_lightning.wire.delta import DeltaFileError, ShapeMismatchError

    assert FromValidation is DeltaRejected
    e = ShapeMismatchError("nodes/w0/delta_3.safetensors", "key 'w' has shape (2,), expected (3,)")
    assert isinstance(e, DeltaRejected) and isinstance(e, DeltaFileError) and isinstance(e, ValueError)
    assert e.reason == "shape" and e.detail == "key 'w' has shape (2,), expected (3,)"
    assert e.path == "nodes/w0/delta_3.safetensors"
    assert str(e) == "nodes/w0/delta_3.safetensors: shape: key 'w' has shape (2,), expected (3,)"
    r = DeltaRejected("too_stale", "the outer optimizer's gate is 0 at staleness 40")
    assert (r.reason, r.detail, str(r)) == ("too_stale", "the outer optimizer's gate is 0 at staleness 40",
                                            "too_stale: the outer optimizer's gate is 0 at staleness 40")


def test_configuration_errors_are_one_family():
    from diloco_lightning.app.checks import ConfigError as AppConfigError
    from diloco_lightning.master.config import MasterConfigError
    from diloco_lightning.util.options import OptionError

    assert AppConfigError is ConfigError
    o = OptionError("wait_timeout", "must be a number > 0, got -1")
    assert isinstance(o, ConfigError) and (o.option, o.key, o.detail) == ("wait_timeout", "wait_timeout", "must be a number > 0, got -1")
    assert str(o) == "wait_timeout must be a number > 0, got -1"
    m = MasterConfigError("the run holds another model")
    assert isinstance(m, ConfigError) and m.key is None and str(m) == "the run holds another model"
    c = ConfigError("diloco.inner_steps", "must be >= 1")
    assert str(c) == "diloco.inner_steps: must be >= 1" and c.key == "diloco.inner_steps"


def test_the_command_line_keeps_its_exit_statuses():
    from diloco_lightning.app.cli import is_config_error, is_user_error
    from diloco_lightning.master.config import MasterConfigError
    from diloco_lightning.util.options import OptionError

    assert is_user_error(ConfigError("seed", "must be >= 0")) and is_config_error(ConfigError("seed", "must be >= 0"))
    assert is_user_error(OptionError("x", "bad")) and is_config_error(OptionError("x", "bad"))
    # a run on the hub that does not match this master: a user error, status 1 (no key to look up in --help)
    assert is_user_error(MasterConfigError("mismatch")) and not is_config_error(MasterConfigError("mismatch"))
    assert not is_user_error(DiLoCoError("a bug"))
