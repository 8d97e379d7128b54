"""A hub's options: one definition (:class:`HubOptions`), one validation.

``open_hub(url, **options)`` takes them as keywords (with the transports' own tuning knobs:
retries, timeouts, part sizes ...); ``train.py`` and ``diloco-master`` compose the same fields into
their ``hub`` section (``diloco_lightning.app.config``) with the help text written here, and check
them here (:meth:`HubOptions.validate`). :meth:`HubOptions.open_options` gives the keywords that
apply to a URL's transport, so one section serves a folder, ``hf://`` and ``s3://``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Any

from diloco_lightning.hub.pacing import DEFAULT_COMMITS_PER_HOUR
from diloco_lightning.util.options import OptionError, option

__all__ = ["DEFAULT_NODE_REPO", "LAYOUTS", "SCHEMES", "HubOptions", "parse_node_repo", "scheme_of"]

#: how an ``hf://`` run lays its files out: one repository, or the master's plus one per node
LAYOUTS = ("shared", "per_node")
#: the built-in transports' URL schemes ("": a plain path); every registered one:
#: :data:`diloco_lightning.hub.transports.TRANSPORTS`
SCHEMES = ("", "file", "hf", "s3")
#: a node's repository with ``layout="per_node"``: ``{org}`` and ``{repo}`` are the master's, ``{node}`` the node id
DEFAULT_NODE_REPO = "{repo}-{node}"
_ADDRESSING = (None, "path", "virtual", "auto")


def parse_node_repo(pattern: str, org: str, repo: str) -> tuple[str, str, str]:
    """``(namespace, prefix, suffix)`` of a node repository pattern: ``<ns>/<prefix>{node}<suffix>``."""
    if not isinstance(pattern, str) or pattern.count("{node}") != 1:
        raise ValueError(f"node_repo {pattern!r} must contain {{node}} exactly once, as in '{DEFAULT_NODE_REPO}'")
    ns_pat, _, name_pat = pattern.rpartition("/")
    if "{node}" in ns_pat:
        raise ValueError(f"node_repo {pattern!r}: {{node}} must be in the repository name, not its namespace")
    head, _, tail = name_pat.partition("{node}")
    try:
        ns = (ns_pat or "{org}").format(org=org, repo=repo)
        prefix, suffix = head.format(org=org, repo=repo), tail.format(org=org, repo=repo)
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"node_repo {pattern!r}: only {{org}}, {{repo}} and {{node}} may appear ({e})") from None
    if not prefix and not suffix:
        raise ValueError(f"node_repo {pattern!r}: the name needs text besides {{node}} (e.g. '{DEFAULT_NODE_REPO}')")
    return ns, prefix, suffix


def scheme_of(url: str | os.PathLike) -> str:
    """``"hf"``, ``"s3"``, ``"file"`` ... (lower case), or ``""`` for a plain path."""
    text = os.fspath(url)
    return text.split("://", 1)[0].lower() if "://" in text else ""


@dataclass
class HubOptions:
    """How a hub is opened (keywords of ``open_hub``; the ``hub`` section of both commands)."""

    create: bool = option(
        True, "create the hub folder / hf:// repository if it does not exist (an S3 bucket is never created)"
    )
    endpoint_url: str | None = option(
        None, "s3://: the store's endpoint URL (MinIO, R2, Ceph ...; default AWS, or $AWS_ENDPOINT_URL_S3); hf://: the "
        "Hub's URL (default https://huggingface.co or $HF_ENDPOINT)"
    )
    endpoint: str | None = option(None, "the same as endpoint_url (an alias: set one of them)")
    region: str | None = option(None, "s3:// only: the bucket's region (default boto3's: $AWS_REGION, the profile ...)")
    addressing_style: str | None = option(None, "s3:// only: path | virtual | auto (MinIO usually needs path)")
    revision: str | None = option(None, "hf:// only: the branch (default main)")
    private: bool = option(True, "hf:// only: a created repository is private")
    layout: str = option(
        "shared", "hf:// only: shared (one repository for the run) | per_node (the URL is the master's repository, each "
        "node writes to its own, named by node_repo: a commit budget per node; see the README)"
    )
    node_repo: str = option(
        DEFAULT_NODE_REPO, "hf:// with layout=per_node: the node repositories' names ({org} and {repo}: the URL's parts; "
        "{node}: the node id; a '/' names another namespace)"
    )
    commits_per_hour: float = option(
        DEFAULT_COMMITS_PER_HOUR, "hf:// only: commits this process makes per repository and hour at most (128: the "
        "Hub's limit on a free account; 0: no limit). A delta beyond it is merged into the next one, a publication "
        "waits. With layout=shared every process commits to one repository: give each its share"
    )
    cache_dir: str | None = option(
        None, "downloads (default $DILOCO_CACHE_DIR or ~/.cache/diloco_lightning, then <hash of the url>)"
    )

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def validate(self, url: str) -> "HubOptions":
        """Raise :class:`~diloco_lightning.util.options.OptionError` naming the first option that is
        out of range or does not apply to ``url``'s transport."""
        scheme = scheme_of(url)
        for name in ("create", "private"):
            if not isinstance(getattr(self, name), bool):
                raise OptionError(name, f"must be true or false, got {getattr(self, name)!r}")
        if scheme != "hf" and self.revision:
            raise OptionError("revision", f"applies to hf:// hubs only (the url is {url!r})")
        for name in ("endpoint_url", "endpoint"):
            if scheme not in ("hf", "s3") and getattr(self, name):
                raise OptionError(name, f"applies to hf:// and s3:// hubs only (the url is {url!r})")
        if self.endpoint and self.endpoint_url and self.endpoint != self.endpoint_url:
            raise OptionError("endpoint_url", f"and endpoint are the same option and disagree ({self.endpoint_url!r}, "
                              f"{self.endpoint!r}); set one of them")
        for name in ("region", "addressing_style"):
            if scheme != "s3" and getattr(self, name):
                raise OptionError(name, f"applies to s3:// hubs only (the url is {url!r})")
        if self.addressing_style not in _ADDRESSING:
            raise OptionError("addressing_style", f"must be path, virtual or auto, got {self.addressing_style!r}")
        if self.layout not in LAYOUTS:
            raise OptionError("layout", f"must be shared or per_node, got {self.layout!r}")
        if scheme != "hf" and self.layout != "shared":
            raise OptionError("layout", f"per_node applies to hf:// hubs only (the url is {url!r})")
        if scheme == "hf" and self.layout == "per_node":
            org, _, name = url[len("hf://"):].strip("/").partition("/")
            try:
                parse_node_repo(self.node_repo, org, name)
            except ValueError as e:
                raise OptionError("node_repo", str(e), str(e)) from None
        cph = self.commits_per_hour
        ok = not isinstance(cph, bool) and isinstance(cph, (int, float)) and math.isfinite(cph) and (cph == 0 or cph >= 1)
        if not ok:
            raise OptionError("commits_per_hour", f"must be 0 (no limit) or >= 1, got {cph}")
        return self

    def open_options(self, url: str, *, create: bool | None = None) -> dict[str, Any]:
        """The ``open_hub`` keywords for ``url``: only those that apply to its transport (``create``:
        instead of :attr:`create`)."""
        opts: dict[str, Any] = {}
        if self.cache_dir:
            opts["cache_dir"] = self.cache_dir
        endpoint = self.endpoint_url or self.endpoint  # one option, two names
        if url.startswith("s3://"):  # a bucket is never created; a prefix needs no creating
            if endpoint:
                opts["endpoint_url"] = endpoint
            for key in ("region", "addressing_style"):
                if getattr(self, key):
                    opts[key] = getattr(self, key)
            return opts
        opts["create"] = bool(self.create) if create is None else create
        if url.startswith("hf://"):
            if endpoint:
                opts["endpoint"] = endpoint
            if self.revision:
                opts["revision"] = self.revision
            opts["private"] = bool(self.private)
            opts["commits_per_hour"] = float(self.commits_per_hour)
            if self.layout == "per_node":
                opts["layout"] = "per_node"
                opts["node_repo"] = self.node_repo
        return opts
