"""Each option has one default, written beside its owner (``WorkerOptions``, ``MasterConfig``,
``SimOptions``, ``HubOptions``): the Hydra schema takes it, the adapters' signatures show it, and no YAML file says it
again. A YAML file that sets an option makes a choice (``diloco=lockstep`` sets ``sync``; the folder
hub polls faster), never a second default; a product key with a meaning of its own is named here
with that meaning in its help."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
import yaml

from diloco_lightning.app import config as schema
from diloco_lightning.hub.options import HubOptions
from diloco_lightning.master.config import MasterConfig
from diloco_lightning.sim.options import SimOptions
from diloco_lightning.util.options import default_of
from diloco_lightning.worker.options import WorkerOptions

#: schema section -> (library option class, keys the product gives a meaning of its own)
SECTIONS: dict[str, tuple[type, type, set[str]]] = {
    "diloco": (schema.DiLoCoConf, WorkerOptions, set()),
    # null: decided by the run (the workers' lockstep quorum and delay); 1: the command owns its process;
    # until_finished true: a training run's master ends with its workers (diloco-master's is false)
    "master": (schema.MasterConf, MasterConfig, {"min_deltas", "keep_globals", "torch_threads", "until_finished"}),
    "sim": (schema.SimConf, SimOptions, set()),
    # false: the commands never create a misspelt hub (the library's open_hub does, as a folder API would)
    "hub": (schema.HubConf, HubOptions, {"create"}),
}


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_the_schema_takes_each_library_default(section):
    conf, options, own = SECTIONS[section]
    library = {f.name for f in dataclasses.fields(options)}
    for f in dataclasses.fields(conf):
        if f.name not in library or f.name in own:
            continue
        assert _default(f) == default_of(options, f.name), f"{section}.{f.name}"
    for name in own:
        help_text = next(f for f in dataclasses.fields(conf) if f.name == name).metadata["help"]
        assert help_text and help_text != next(f for f in dataclasses.fields(options) if f.name == name).metadata["help"]


def test_the_outer_group_defaults_are_the_masters():
    fields = {f.name: f for f in dataclasses.fields(schema.OuterConf)}
    assert fields["name"].default == default_of(MasterConfig, "outer_optimizer")
    assert fields["lr"].default == default_of(MasterConfig, "outer_lr")


@pytest.mark.parametrize("adapter", ["diloco_lightning.adapters.lightning", "diloco_lightning.adapters.accelerate"])
def test_the_adapters_show_the_library_defaults(adapter):
    import importlib

    sig = inspect.signature(importlib.import_module(adapter).DiLoCo.__init__)
    names = set(WorkerOptions.names())
    shown = {n: p.default for n, p in sig.parameters.items() if n in names}
    assert set(shown) == names  # every option is a keyword of the adapter
    # DiLoCo(hub, node_id, inner_steps): required, unless the options are given whole (options=WorkerOptions(...))
    assert shown.pop("inner_steps") is None and sig.parameters["options"].default is None
    assert shown == {n: default_of(WorkerOptions, n) for n in shown}
    args = (object(), object(), "hub") if "accelerate" in adapter else ("hub",)
    with pytest.raises(TypeError, match="inner_steps"):
        importlib.import_module(adapter).DiLoCo(*args, node_id="w0")
    with pytest.raises(TypeError, match="valid: .*inner_steps"):  # an unknown keyword names the valid ones
        importlib.import_module(adapter).DiLoCo(*args, node_id="w0", inner_step=4)


def _yaml_options(path: Path) -> dict[str, dict[str, Any]]:
    """``section -> {key: value}`` a config file sets, for the sections with a library option class."""
    text = path.read_text()
    node = yaml.safe_load(text) or {}
    package = "_global_" if "# @package _global_" in text else path.parent.name
    if path.parent.name == "configs":
        package = "_global_" if path.name == "train.yaml" else "master"  # diloco-master: the master keys on top
    if package != "_global_":
        node = {package: node}
    return {s: v for s, v in node.items() if s in SECTIONS and isinstance(v, dict)}


CONFIGS = sorted(p for p in schema.CONFIG_DIR.rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(schema.CONFIG_DIR)) for p in CONFIGS])
def test_no_yaml_file_says_a_default_again(path):
    for section, values in _yaml_options(path).items():
        conf, options, own = SECTIONS[section]
        library = set(options.names()) - own
        if path.parent == schema.CONFIG_DIR:  # train.yaml, master.yaml: the defaults are the library's
            assert not library.intersection(values), f"{path.name} sets {sorted(library.intersection(values))}"
        for key, value in values.items():
            if key in library and value != path.stem:  # a group option says the value it is named for (sync: async)
                assert value != default_of(options, key), f"{path}: {section}.{key}: {value!r} is the default already"


def test_the_composed_commands_use_the_library_defaults():
    """What the two commands run with, key by key: the library's value unless a chosen group sets it."""
    from diloco_lightning.app.cli import _compose

    schema.register_configs()
    cfg = _compose("train", ["hub=hf", "hub.url=hf://org/run"])  # the one group that sets nothing of these
    for key in ("inner_steps", "dylu_steps", "wait_timeout", "poll_interval", "claim_ttl", "delta_dtype"):
        assert cfg.diloco[key] == default_of(WorkerOptions, key), key
    assert cfg.diloco.sync == "lockstep"  # configs/train.yaml chooses the diloco=lockstep group
    assert cfg.master.poll_interval == default_of(MasterConfig, "poll_interval")
    folder = _compose("train", [])
    assert folder.diloco.poll_interval == folder.master.poll_interval == 0.05  # configs/hub/file.yaml's choice
    master = _compose("master", ["hub.url=/tmp/hub"])
    for key in ("poll_interval", "norm_ratio", "lease_ttl", "gc_every", "aggregation"):
        assert master[key] == default_of(MasterConfig, key), key


def test_keep_globals_follows_the_lockstep_delay():
    from diloco_lightning.app.build import run_master_config
    from diloco_lightning.app.cli import _compose

    schema.register_configs()
    assert run_master_config(_compose("train", ["recipe=tiny"])).keep_globals == default_of(MasterConfig, "keep_globals")
    assert run_master_config(_compose("train", ["recipe=llama25m_tau16"])).keep_globals == 18
    assert run_master_config(_compose("train", ["recipe=tiny", "master.keep_globals=2"])).keep_globals == 2
    assert run_master_config(_compose("train", ["recipe=tiny", "diloco=async", "diloco.delay=9"])).keep_globals == 4


def test_diloco_master_averages_every_live_workers_delta_by_default():
    """``diloco-master`` with no ``outer=`` / ``min_deltas=``: plain averaging of every live worker's
    delta (outer SGD lr 1, no momentum; configs/outer/fedavg.yaml and configs/master.yaml), the choice
    measured stable on both foreign modules (benchmarks/foreign_modules.py); ``outer=nesterov`` is
    DiLoCo's own (lr 0.7, momentum 0.9), a choice a user makes."""
    from diloco_lightning.app.checks import master_config
    from diloco_lightning.app.cli import _compose

    schema.register_configs()
    cfg = _compose("master", ["hub.url=/tmp/hub"])
    config = master_config(cfg, cfg.outer)
    assert (config.outer_optimizer, config.optimizer_options(), config.min_deltas) == (
        "fedavg", {"lr": 1.0, "momentum": 0.0, "power": 0.0}, 1.0)  # the plain mean (power 0: no staleness gate)
    cfg = _compose("master", ["hub.url=/tmp/hub", "outer=nesterov", "min_deltas=2"])
    config = master_config(cfg, cfg.outer)
    assert (config.optimizer_options(), config.min_deltas) == ({"lr": 0.7, "momentum": 0.9}, 2)


def test_the_sparseloco_preset_is_what_its_docs_say():
    """``compression=sparseloco``: ctopk 64 of every 4096 in 2 bits, error feedback with beta 0.8, and
    the plain outer step gated by staleness (staleness_sgd, momentum 0, power 1: SparseLoCo's step at
    tau = 0), lr 2; it passes the run's validation and builds that outer optimizer."""
    import torch

    from diloco_lightning.app.cli import _checked_args, _compose
    from diloco_lightning.app.config import validate
    from diloco_lightning.outer import build_outer_optimizer

    schema.register_configs()
    assert _checked_args("train", ["recipe=tiny", "compression=sparseloco"])  # the command line takes the group
    cfg = _compose("train", ["recipe=tiny", "compression=sparseloco"])
    d = cfg.diloco
    assert (d.delta_dtype, d.topk, d.topk_values, d.topk_chunk) == ("ctopk", 0.015625, "int2", 4096)
    assert d.error_feedback is True and d.error_feedback_decay == 0.8  # the compression study's, not 0.95
    assert (cfg.outer.name, cfg.outer.lr, dict(cfg.outer.options)) == ("staleness_sgd", 2.0, {"momentum": 0.0, "power": 1.0})
    validate(cfg)
    state = {"w": torch.zeros(3)}
    outer = build_outer_optimizer(cfg.outer.name, state, lr=cfg.outer.lr, **cfg.outer.options)
    outer.step(state, {"w": torch.ones(3)}, staleness=3)
    assert torch.equal(state["w"], torch.full((3,), -0.5))  # theta -= lr * g / (1 + tau)


def test_the_library_default_outer_step_is_fedavg_and_nesterov_by_name_keeps_speedtronics():
    """One outer default (docs/scaling.md): the library's MasterConfig builds fedavg (lr 1, momentum 0), as
    train.py and diloco-master do; Nesterov chosen by name keeps Speedtronic's lr 0.7 and momentum 0.9 (SPEC)."""
    assert MasterConfig().outer_optimizer == "fedavg"
    assert MasterConfig().optimizer_options() == {"lr": 1.0, "momentum": 0.0}
    # the library's fedavg is the plain mean, as the CLI's configs/outer/fedavg.yaml says (power 0)
    import torch

    from diloco_lightning.outer import build_outer_optimizer

    assert build_outer_optimizer("fedavg", {"w": torch.zeros(1)}, **MasterConfig().optimizer_options()).power == 0.0
    assert MasterConfig(outer_optimizer="nesterov").optimizer_options() == {"lr": 0.7, "momentum": 0.9}
    assert MasterConfig(outer_optimizer="fedavg", outer_lr=0.5).optimizer_options() == {"lr": 0.5, "momentum": 0.0}
    for path in ("configs/train.yaml", "configs/master.yaml"):
        assert "outer: fedavg" in (Path(__file__).resolve().parents[1] / path).read_text()


def test_outer_momentum_is_honoured_by_every_step_with_a_momentum_and_ignored_aloud_by_the_others(caplog):
    """It was silently dropped for staleness_sgd (its momentum stayed 0)."""
    def opts(name, **kw):
        return MasterConfig(outer_optimizer=name, outer_lr=0.5, **kw).validate().optimizer_options()

    assert opts("staleness_sgd", outer_momentum=0.5)["momentum"] == 0.5
    assert "momentum" not in opts("staleness_sgd")  # its own default (0)
    assert opts("nesterov")["momentum"] == 0.9 and opts("fedavg")["momentum"] == 0.0
    with caplog.at_level("WARNING", logger="diloco_lightning.master.config"):
        assert "momentum" not in opts("adam", outer_momentum=0.9)
    assert "outer_momentum=0.9 is ignored: adam has no momentum" in caplog.text
