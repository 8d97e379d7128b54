"""``diloco-export``: a hub's newest global model as a plain safetensors file, in one command.

    diloco-export hub.url=/shared/diloco/run1 out=./final_model
    diloco-export hub.url=hf://my-org/my-run out=./final_model     # HF_TOKEN from the environment
    diloco-export --help

Writes ``<out>/model.safetensors`` (load it with ``safetensors.torch.load_file`` and
``module.load_state_dict``) and ``<out>/diloco_global.json`` (outer_step, model fingerprint, the
file's SHA-256): :func:`diloco_lightning.hub.versions.export_global`, which reads the version as
a worker's install does (SHA-256 and fingerprint checked; in a signed run, ``DILOCO_RUN_KEY`` /
``DILOCO_RUN_KEY_FILE`` set, the manifest's signature too).

The arguments are ``key=value`` with the same ``hub`` section as ``diloco-master`` (``hub.url``,
``hub.token`` ... : :class:`~diloco_lightning.app.config.HubConf`), so the hub part of the master's
command line works here unchanged; they are parsed by OmegaConf against :class:`ExportConf`, not
run as a Hydra app (an export writes no run folder and needs no sweeps).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from diloco_lightning.app.config import HubConf
from diloco_lightning.util.options import option

__all__ = ["ExportConf", "export", "main"]

log = logging.getLogger(__name__)

USAGE = """usage: diloco-export hub.url=URL out=FOLDER [hub.<key>=...]

Writes the hub's newest global model to FOLDER/model.safetensors (a plain safetensors file of the
model's state_dict) and FOLDER/diloco_global.json (its outer_step and model fingerprint).

keys:
  hub.url    file:///abs/path, a plain path, hf://org/repo or s3://bucket/prefix (required)
  out        the folder to write (created if missing; default ./final_model)
  hub.*      the hub options of diloco-master (token, endpoint, cache_dir, endpoint_url ...)
The run key of a signed run comes from DILOCO_RUN_KEY / DILOCO_RUN_KEY_FILE."""


@dataclass
class ExportConf:
    """``diloco-export``'s keys."""

    hub: HubConf = option(help="", factory=HubConf)  # type: ignore[valid-type]
    out: str = option("final_model", "the folder model.safetensors and diloco_global.json are written to")


def export(argv: list[str]) -> str:
    """Export as ``argv`` (``key=value`` strings) says; the path written. Errors are the project's
    user errors (``ConfigError`` naming the key, ``NothingPublishedError``)."""
    from omegaconf import OmegaConf

    from diloco_lightning.app.config import open_configured_hub
    from diloco_lightning.hub.versions import export_global
    from diloco_lightning.util.errors import ConfigError
    from diloco_lightning.wire.signing import load_run_key

    bad = [a for a in argv if "=" not in a or a.startswith("-")]
    if bad:
        raise ConfigError(bad[0].split("=")[0], "is not a key=value argument (diloco-export hub.url=URL out=FOLDER)")
    base = OmegaConf.structured(ExportConf)
    try:
        cfg = OmegaConf.merge(base, OmegaConf.from_dotlist(list(argv)))
    except Exception as e:  # noqa: BLE001 - an unknown key or a bad value: name it
        key = getattr(e, "full_key", None) or "arguments"
        raise ConfigError(str(key), f"{str(e).splitlines()[0]} (diloco-export --help lists the keys)") from None
    if OmegaConf.is_missing(cfg.hub, "url") or not cfg.hub.url:
        raise ConfigError("hub.url", "is required: diloco-export hub.url=URL out=FOLDER")
    hub = open_configured_hub(cfg.hub)
    try:
        path = export_global(hub, cfg.out, signing_key=load_run_key(None))
    finally:
        hub.close()
    return str(path)


def main(argv: list[str] | None = None) -> None:
    """The ``diloco-export`` console script."""
    from diloco_lightning.app.cli import report_error, is_user_error
    from diloco_lightning.hub.versions import NothingPublishedError

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return
    verbose = any(a in ("-v", "--verbose") for a in args)
    args = [a for a in args if a not in ("-v", "--verbose")]
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        path = export(args)
    except NothingPublishedError as e:
        print(f"diloco-export: error: {e}; start the run's master (diloco-master) and its workers first",
              file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # noqa: BLE001 - a user error in one or two lines; anything else with its traceback
        if verbose or not is_user_error(e):
            raise
        sys.exit(report_error("diloco-export", e))
    print(f"diloco-export: wrote {path} (and {path.rsplit('/', 1)[0]}/diloco_global.json)")


if __name__ == "__main__":
    main()
