"""What ``train.py`` / ``diloco-train`` and ``diloco-master`` share at the command line.

* **Errors a user can fix end in one or two lines** on stderr (``<prog>: error: ...`` and a
  hint), exit status 2 for a configuration error, 1 for the others: configuration values
  (:class:`~diloco_lightning.app.config.ConfigError`, Hydra's composition errors), the hub
  (``HubError``: missing folder, authentication, a hub that stays down), the worker and
  master (``WorkerError``, ``MasterConfigError``), the machine
  (:class:`~diloco_lightning.app.resources.ResourceError`) and a failed run
  (:class:`~diloco_lightning.app.errors.RunError`, with the failing worker's log tail). Anything
  else is a bug and keeps its traceback. ``-v`` (or ``HYDRA_FULL_ERROR=1``) shows the
  traceback of every error.
* **Signals**: :class:`~diloco_lightning.app.errors.Interrupted` (Ctrl-C, SIGTERM) ends with one
  line and status ``128 + signal`` (130, 143).
* **Values with a further ``=``** (``hub.url=runs/recipe=tiny/hub``, the run folders this command
  names after its overrides) are quoted for Hydra before it parses them
  (:func:`~diloco_lightning.app.keys.quote_values`): a printed path pastes back as printed.
* **--help** lists the command's groups (with their options) and one line per key: its
  current value (with the overrides given) and what it does, from the schema
  (:mod:`diloco_lightning.app.config`), the same text as ``docs/configuration.md``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable

from diloco_lightning.app.errors import is_config_error, is_user_error, short_message  # noqa: F401 - their old home

__all__ = ["run_app", "train_main", "help_text", "short_message", "is_user_error", "configuration_markdown"]

#: (config name, schema, config groups, one-line description) of each command
_COMMANDS = {
    "train": (
        "TrainConf",
        ("recipe", "model", "data", "optim", "diloco", "compression", "outer", "hub", "trainer", "launch"),
        "Train a Llama with asynchronous DiLoCo: a master and `workers` worker processes on this machine "
        "(role=all), or one worker / one master of a multi-machine run (role=worker / role=master).",
    ),
    "master": (
        "MasterCommandConf",
        ("outer",),
        "A DiLoCo master that needs no model code: applies the workers' deltas with a staleness-aware "
        "outer optimizer and publishes new global weights on the hub.",
    ),
}

_VERBOSE_FLAGS = ("-v", "--verbose")
_HELP_FLAGS = ("-h", "--help")


def _schema(name: str) -> type:
    from diloco_lightning.app import config

    return getattr(config, _COMMANDS[name][0])


# ----------------------------------------------------------------------------- errors


def report_error(prog: str, e: BaseException) -> int:
    from diloco_lightning.app.errors import RunError

    config = is_config_error(e)
    if isinstance(e, RunError):  # a failed run: its message carries the failing worker's log tail
        print(f"{prog}: error: {e}", file=sys.stderr)
    else:
        print(f"{prog}: error: {short_message(e)}", file=sys.stderr)
    hint = "--help lists every key; " if config else ""
    print(f"{prog}: ({hint}-v or HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
    return 2 if config else 1


# ----------------------------------------------------------------------------- help


def _compose(config_name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from diloco_lightning.app.config import CONFIG_DIR, register_configs

    register_configs()
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        return compose(config_name, overrides=overrides)


def _key_lines(config_name: str, cfg) -> list[tuple[str, str, str]]:
    from omegaconf import OmegaConf

    from diloco_lightning.app.config import describe, format_value

    raw = OmegaConf.to_container(cfg, resolve=False) if cfg is not None else None
    rows = []
    for key, value, help in describe(_schema(config_name), cfg):
        node: Any = raw
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        shown = node if isinstance(node, str) and "${" in node else value
        rows.append((key, format_value(shown), help))
    return rows


def help_text(config_name: str, prog: str, overrides: list[str] | None = None) -> str:
    """``--help`` of a command: its groups (with options) and one line per key."""
    from diloco_lightning.app.config import group_options
    from diloco_lightning.app.keys import plain_override

    _, groups, about = _COMMANDS[config_name]
    cfg = _compose(config_name, list(overrides or []))
    lines = [f"usage: {prog} [GROUP=OPTION ...] [KEY=VALUE ...] [-m] [-v] [--help]", "", about, ""]
    lines.append("Groups (GROUP=OPTION):")
    for group in groups:
        opts = group_options(group)
        lines.append(f"  {group}: " + ", ".join(name for name, _ in opts))
        for name, desc in opts:
            if desc:
                lines.append(f"      {name:<18} {desc}")
    rows = _key_lines(config_name, cfg)
    width = max(len(k) + len(v) for k, v, _ in rows) + 3
    given = " ".join(plain_override(o) for o in overrides or [])
    lines += ["", "Keys (KEY=VALUE; the value below is the current one" + (f", with {given}" if given else "") + "):"]
    for key, value, help in rows:
        left = f"{key}={value}"
        if len(left) > 48:
            lines.append(f"  {left}")
            lines.append(f"  {'':<48} {help}")
        else:
            lines.append(f"  {left:<{min(width, 48)}} {help}")
    lines += [
        "",
        "Flags: -m runs a sweep over comma-separated values; -v shows tracebacks; --cfg job prints the "
        "composed config; --hydra-help lists Hydra's own flags. Every key: docs/configuration.md.",
    ]
    return "\n".join(lines)


def configuration_markdown() -> str:
    """``docs/configuration.md``: every key of both commands, its default and its meaning."""
    from diloco_lightning.app.config import group_options

    out = [
        "# Configuration",
        "",
        "Generated from the schema (`diloco_lightning/app/config.py`) by "
        "`python -m diloco_lightning.app.cli --write-docs`; `tests/test_cli.py` checks it is current.",
        "Each key is set on the command line as `key=value`; a group is chosen as `group=option`.",
        "`python train.py --help` and `diloco-master --help` print the same lines with the values in effect.",
        "",
    ]
    for config_name, title, cmd in (("train", "`python train.py` / `diloco-train`", "configs/train.yaml"),
                                    ("master", "`diloco-master`", "configs/master.yaml")):
        _, groups, about = _COMMANDS[config_name]
        out += [f"## {title}", "", about, "", f"Defaults: `{cmd}` with the groups' defaults.", "", "### Groups", ""]
        out += ["| group | options |", "| --- | --- |"]
        for group in groups:
            opts = group_options(group)
            text = "<br>".join(f"`{n}`{': ' + d if d else ''}" for n, d in opts)
            out.append(f"| `{group}` | {text} |")
        out += ["", "### Keys", "", "| key | default | meaning |", "| --- | --- | --- |"]
        cfg = _compose(config_name, [])
        for key, value, help in _key_lines(config_name, cfg):
            value = value.replace("|", "\\|")
            out.append(f"| `{key}` | `{value}` | {help.replace('|', chr(92) + '|')} |")
        out.append("")
    return "\n".join(out)


# ----------------------------------------------------------------------------- running a command


def _checked_args(config_name: str, args: list[str]) -> list[str]:
    """The command line with ``diloco-master``'s aliases applied (``master.poll_interval`` ->
    ``poll_interval``); an unknown key, ``+`` or not, is a :class:`ConfigError` naming the closest
    known one (:mod:`diloco_lightning.app.keys`)."""
    from diloco_lightning.app.keys import check_override_keys, master_aliases

    schema = _schema(config_name)
    groups = _COMMANDS[config_name][1]
    aliases = None
    if config_name == "master":
        from diloco_lightning.app.config import MasterConf

        args = master_aliases(args, {f.name for f in dataclasses.fields(MasterConf)})
        aliases = {"master": "diloco-master takes train.py's master.* keys at the top level, e.g. poll_interval=1"}
    check_override_keys(args, schema, groups, aliases=aliases)
    return args


def _drop_refused_run(cfg: Any) -> None:
    """A command refused at start-up leaves no run folder: the one Hydra made for this job goes when it
    holds nothing but Hydra's own files (:func:`diloco_lightning.app.console.drop_unused_run_dir`)."""
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from diloco_lightning.app.console import drop_unused_run_dir

    try:
        hc = HydraConfig.get()
    except ValueError:
        return
    if hc.mode != RunMode.RUN or not hc.runtime.output_dir:
        return
    root = cfg.get("run_root") if hasattr(cfg, "get") else None
    drop_unused_run_dir(Path(hc.runtime.output_dir), Path(root).resolve() if root else None)


def run_app(prog: str, config_name: str, task: Callable[[Any], Any], argv: list[str] | None = None) -> None:
    """Run ``task`` as the Hydra app ``config_name`` with this module's error, signal and help handling."""
    from diloco_lightning.util import timeline

    timeline.mark("cli")
    import hydra

    from diloco_lightning.app.config import CONFIG_DIR, register_configs
    from diloco_lightning.app.keys import quote_values

    args = list(sys.argv[1:] if argv is None else argv)
    verbose = any(a in _VERBOSE_FLAGS for a in args) or os.environ.get("HYDRA_FULL_ERROR") == "1"
    args = [a for a in args if a not in _VERBOSE_FLAGS]
    try:
        args = _checked_args(config_name, quote_values(args))
    except Exception as e:  # noqa: BLE001 - an unknown key: refused before Hydra creates anything
        if verbose or not is_user_error(e):
            raise
        sys.exit(report_error(prog, e))
    if any(a in _HELP_FLAGS for a in args):
        overrides = [a for a in args if "=" in a and not a.startswith("-")]
        try:
            print(help_text(config_name, prog, overrides))
        except Exception as e:  # noqa: BLE001 - a bad override given with --help
            if verbose or not is_user_error(e):
                raise
            sys.exit(report_error(prog, e))
        return
    sys.argv = [sys.argv[0]] + args
    register_configs()
    from diloco_lightning.app.errors import Interrupted, Signal

    caught: list[BaseException] = []

    def job(cfg: Any) -> Any:
        # errors of the job are kept here rather than raised through Hydra, which would print its own
        # "Error executing job" line first; a sweep goes on with its other jobs, as Hydra's does
        try:
            return task(cfg)
        except Interrupted as e:
            caught.append(e)
            raise KeyboardInterrupt from e  # ends a sweep too
        except Exception as e:
            if verbose or not is_user_error(e):
                raise
            caught.append(e)
            if config_name == "train":  # only train.py makes run folders
                _drop_refused_run(cfg)
            return None

    job.__module__, job.__qualname__ = task.__module__, task.__qualname__
    # Hydra raises instead of printing its own report; this function reports (or, verbose, re-raises)
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        hydra.main(version_base=None, config_path=str(CONFIG_DIR), config_name=config_name)(job)()
    except BaseException as e:  # noqa: BLE001 - sorted below
        if isinstance(e, SystemExit):
            raise
        if isinstance(e, Signal):  # SIGTERM where the command turns it into an exception (terminate_as_exception)
            print(f"{prog}: stopped by {e}", file=sys.stderr)
            sys.exit(128 + e.signum)
        if isinstance(e, KeyboardInterrupt):
            first = caught[0] if caught and isinstance(caught[0], Interrupted) else None
            print(f"{prog}: {first if first is not None else 'interrupted (Ctrl-C)'}", file=sys.stderr)
            sys.exit(first.exit_code if first is not None else 130)
        if verbose or not is_user_error(e):
            raise
        sys.exit(report_error(prog, e))
    if caught:
        sys.exit(report_error(prog, caught[0]))


def _train_task(cfg) -> float | None:
    from diloco_lightning.app.run import run

    results = run(cfg)
    # the return value is what Hydra sweepers optimise: the final eval loss
    return None if results is None else results.get("eval_loss")


def train_main() -> None:
    """``python train.py`` / ``diloco-train``."""
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "diloco-train"
    run_app(prog if prog.endswith(".py") or prog.startswith("diloco") else "diloco-train", "train", _train_task)


def main(argv: list[str] | None = None) -> int:
    """``python -m diloco_lightning.app.cli --write-docs [PATH]``: regenerate ``docs/configuration.md``."""
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--write-docs", nargs="?", const="docs/configuration.md", required=True, metavar="PATH")
    args = ap.parse_args(argv)
    Path(args.write_docs).write_text(configuration_markdown())
    print(f"wrote {args.write_docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
