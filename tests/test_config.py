"""Every recipe composes with real Hydra and instantiates; bad configs fail naming the key."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from diloco_lightning.app.config import CONFIG_DIR, RECIPE_DIR, ConfigError, register_configs, run_id_from_overrides, validate
from diloco_lightning.outer import OUTER_OPTIMIZERS, build_outer_optimizer

register_configs()
RECIPES = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))
REQUIRED = ["tiny"] + [f"llama25m_tau{t}" for t in (0, 4, 8, 16)] + [f"llama1b_tau{t}" for t in (0, 8, 16)] + [
    f"llama7b_tau{t}" for t in (0, 8)
]


def _compose(*overrides: str):
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        return compose("train", overrides=list(overrides))


def test_required_recipes_exist():
    assert set(REQUIRED) <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_and_instantiates(recipe):
    from diloco_lightning.app.build import model_config, outer_options
    from diloco_lightning.models.llama import Llama

    cfg = validate(_compose(f"recipe={recipe}"))
    assert cfg.diloco.inner_steps == 8
    if recipe == "tiny" or recipe.endswith("_tau0"):  # no imposed delay: the default, fedavg (docs/scaling.md)
        assert cfg.outer.name == "fedavg" and cfg.outer.lr == 1.0 and dict(cfg.outer.options) == {"momentum": 0.0, "power": 0.0}
    else:  # an imposed delay: staleness-scaled SGD (docs/study.md)
        assert cfg.outer.name == "staleness_sgd" and cfg.outer.lr == 0.5 and dict(cfg.outer.options) == {"momentum": 0.0, "power": 1.0}
    if "_tau" in recipe:
        assert cfg.diloco.delay == int(recipe.rsplit("_tau", 1)[1])
    if recipe.startswith(("llama1b", "llama7b")):
        assert cfg.optim.name == "adamw8bit" and cfg.trainer.precision == "bf16-true"
    mc = model_config(cfg, vocab_size=cfg.data.vocab_size)
    with torch.device("meta"):
        model = Llama(mc)
    n = sum(p.numel() for p in model.parameters())
    expected = {"llama1b": 1.10e9, "llama7b": 6.74e9, "llama25m": 24e6}.get(cfg.model.preset)
    if expected:
        assert n == pytest.approx(expected, rel=0.05 if cfg.model.preset == "llama25m" else 0.005)
    # the outer optimizer the recipe names builds with the recipe's options
    state = {"w": torch.zeros(3)}
    opt = build_outer_optimizer(cfg.outer.name, state, **outer_options(cfg))
    assert opt.name == cfg.outer.name


@pytest.mark.parametrize("outer", sorted(p.stem for p in (CONFIG_DIR / "outer").glob("*.yaml")))
def test_every_outer_config_builds(outer):
    from diloco_lightning.app.build import outer_options

    cfg = validate(_compose("recipe=tiny", f"outer={outer}"))
    assert cfg.outer.name in OUTER_OPTIMIZERS
    build_outer_optimizer(cfg.outer.name, {"w": torch.zeros(2, 2)}, **outer_options(cfg))


@pytest.mark.parametrize(
    "overrides, exc, key",
    [
        (["recipe=nope"], MissingConfigException, "recipe/nope"),
        (["outer=nope"], MissingConfigException, "outer/nope"),
        (["diloco.reset_inner_optimizer=maybe"], ConfigCompositionException, "diloco.reset_inner_optimizer"),
        (["trainer.max_stepz=3"], ConfigCompositionException, "trainer.max_stepz"),
        (["unknown_key=1"], ConfigCompositionException, "unknown_key"),
    ],
)
def test_bad_config_fails_at_composition(overrides, exc, key):
    with pytest.raises(exc) as ei:
        _compose(*overrides)
    text = str(ei.value) + str(ei.value.__cause__ or "")
    assert key in text


@pytest.mark.parametrize(
    "override, key",
    [
        ("diloco.inner_steps=0", "diloco.inner_steps"),
        ("diloco.inner_steps=eight", "diloco.inner_steps"),
        ("diloco.throttle=[0,-1]", "diloco.throttle[1]"),
        ("diloco.dylu_min_steps=500", "diloco.dylu_min_steps"),
        ("master.min_deltas=1.5", "master.min_deltas"),
        ("master.min_deltas=0", "master.min_deltas"),
        ("master.max_wait=soon", "master.max_wait"),
        ("master.node_timeout=0", "master.node_timeout"),
        ("diloco.delay=-1", "diloco.delay"),
        ("diloco.delay=[0,-2]", "diloco.delay[1]"),
        ("diloco.sync=sometimes", "diloco.sync"),
        ("diloco.delta_dtype=int2", "diloco.delta_dtype"),
        ("diloco.topk=0", "diloco.topk"),
        ("diloco.topk=1.5", "diloco.topk"),
        ("diloco.topk_values=int2", "diloco.topk_values"),
        ("outer.name=sgd", "outer.name"),
        ("optim.name=lion", "optim.name"),
        ("workers=0", "workers"),
        ("node_index=5", "node_index"),
        ("trainer.precision=fp8", "trainer.precision"),
        ("data.source=text", "data.paths"),
    ],
)
def test_out_of_range_values_name_the_key(override, key):
    cfg = _compose("recipe=tiny", override)
    with pytest.raises(ConfigError) as ei:
        validate(cfg)
    assert ei.value.key == key and str(ei.value).startswith(key)


def test_unknown_outer_lists_valid_ones():
    cfg = _compose("recipe=tiny", "outer.name=sgd")
    with pytest.raises(ConfigError, match="cgad"):
        validate(cfg)


def test_run_id_is_deterministic_and_ignores_per_process_keys():
    a = run_id_from_overrides(["recipe=tiny", "seed=1", "role=worker", "node_index=3"])
    b = run_id_from_overrides(["seed=1", "recipe=tiny", "role=master"])
    assert a == b == "recipe=tiny,seed=1"
    assert run_id_from_overrides([]) == "default"
    long = run_id_from_overrides([f"data.paths=/x/{'y' * 300}"])
    assert len(long) <= 120 and "/" not in long
    cfg = _compose("recipe=tiny")
    assert cfg.run_id == "default"  # composed outside an app: no command line


def test_heterogeneous_delays_are_per_worker_and_seeded():
    from diloco_lightning.app.build import regime, tau_label, worker_delay

    cfg = validate(_compose("recipe=tiny", "workers=4", "diloco.delay=[0,2,4,8]"))
    assert [worker_delay(cfg, i) for i in range(4)] == [0, 2, 4, 8]
    assert regime(cfg) == "heterogeneous" and tau_label(cfg) == "8"
    cfg = validate(_compose("recipe=tiny", "workers=4", "diloco.delay={distribution:uniform,low:0,high:8,seed:3}"))
    draws = [worker_delay(cfg, i) for i in range(4)]
    assert draws == [worker_delay(cfg, i) for i in range(4)] and all(0 <= d <= 8 for d in draws)


def test_chance_level_of_the_paper_vocabulary():
    # REFERENCES.md: the CGAD paper's chance-level loss 10.83 = ln(~50.3k)
    cfg = _compose("recipe=llama25m_tau8")
    assert math.log(cfg.model.vocab_size) == pytest.approx(10.83, abs=0.01)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["hub.url=s3://b/run", "hub.endpoint_url=http://a:1", "hub.endpoint=http://b:2"], "hub.endpoint_url"),
        (["hub.url=/tmp/h", "hub.endpoint_url=http://a:1"], "hub.endpoint_url"),
        (["hub.url=hf://org/run", "hub.region=eu-west-1"], "hub.region"),
        (["hub.url=s3://b/run", "hub.addressing_style=sideways"], "hub.addressing_style"),
        (["hub.url=/tmp/h", "hub.layout=per_node"], "hub.layout"),
        (["hub.url=hf://org/run", "hub.layout=star"], "hub.layout"),
        (["hub.url=hf://org/run", "hub.layout=per_node", "hub.node_repo='{repo}'"], "hub.node_repo"),
        (["hub.url=hf://org/run", "hub.commits_per_hour=0.5"], "hub.commits_per_hour"),
    ],
)
def test_hub_options_are_checked_for_their_transport(overrides, key):
    with pytest.raises(ConfigError) as ei:
        validate(_compose("recipe=tiny", *overrides))
    assert ei.value.key == key


def test_hub_options_reach_each_transport():
    """hub.endpoint_url is the one option (hub.endpoint an alias of it); each transport gets what applies to it."""
    from diloco_lightning.app.config import hub_options

    cfg = validate(_compose("recipe=tiny", "hub.url=s3://b/run", "hub.endpoint_url=http://127.0.0.1:9",
                            "hub.region=eu-west-1", "hub.addressing_style=path"))
    assert hub_options(cfg.hub, cfg.hub.url) == {"endpoint_url": "http://127.0.0.1:9", "region": "eu-west-1",
                                                  "addressing_style": "path"}
    cfg = validate(_compose("recipe=tiny", "hub.url=s3://b/run", "hub.endpoint=http://127.0.0.1:9"))
    assert hub_options(cfg.hub, cfg.hub.url) == {"endpoint_url": "http://127.0.0.1:9"}
    cfg = validate(_compose("recipe=tiny", "hub=hf", "hub.url=hf://org/run", "hub.endpoint_url=http://127.0.0.1:9",
                            "hub.layout=per_node", "hub.commits_per_hour=64"))
    assert hub_options(cfg.hub, cfg.hub.url) == {
        "create": False, "endpoint": "http://127.0.0.1:9", "private": True, "commits_per_hour": 64.0,
        "layout": "per_node", "node_repo": "{repo}-{node}"}
    cfg = validate(_compose("recipe=tiny", "hub=s3", "hub.url=s3://b/run"))
    assert hub_options(cfg.hub, cfg.hub.url) == {}


def test_encoding_options_compose_into_the_worker_keywords():
    from diloco_lightning.app.config import worker_options
    from diloco_lightning.worker.options import WorkerOptions

    cfg = validate(_compose("recipe=tiny", "diloco.delta_dtype=topk", "diloco.topk=0.02", "diloco.topk_values=int4",
                            "diloco.error_feedback=false"))
    opts = WorkerOptions(**worker_options(cfg.diloco))
    assert (opts.encoding.name, opts.encoding.topk, opts.encoding.topk_values, opts.feedback) == ("topk", 0.02, "int4", False)
    opts = WorkerOptions(**worker_options(validate(_compose("recipe=tiny", "diloco.delta_dtype=int4")).diloco))
    assert opts.encoding.name == "int4" and opts.feedback is True  # on by default for the quantized encodings


def test_the_outer_lr_is_one_value_whichever_spelling():
    """``outer.lr`` and the library's spelling ``outer.options.lr`` (``MasterConfig.outer_options``) are one
    learning rate: the latter is used when the former is null, two different values are one error naming
    the key (it used to be dropped silently in favour of ``outer.lr``)."""
    from diloco_lightning.app.build import outer_options
    from diloco_lightning.util.errors import ConfigError

    assert outer_options(_compose("recipe=tiny", "outer.lr=null", "+outer.options.lr=0.25"))["lr"] == 0.25
    assert outer_options(_compose("recipe=tiny", "outer.lr=0.25", "+outer.options.lr=0.25"))["lr"] == 0.25
    assert outer_options(_compose("recipe=tiny", "outer.lr=0.5"))["lr"] == 0.5
    with pytest.raises(ConfigError, match=r"outer\.options\.lr.*given twice.*keep outer\.lr"):
        outer_options(_compose("recipe=tiny", "outer.lr=0.5", "+outer.options.lr=0.25"))
