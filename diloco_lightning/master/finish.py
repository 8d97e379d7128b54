"""When a run is over for its master (``MasterConfig.until_finished``).

A worker whose training ended leaves a claim that says so (``info.finished`` and its last delta's
``local_step``: :meth:`~diloco_lightning.worker.claim.ClaimKeeper.finish`). The run is over when
the master knows at least one node, every node it knows (:class:`~diloco_lightning.master.membership.Membership`)
has finished, and each one's last delta is applied (the published ledger holds its ``local_step``)
or was refused (a refused delta never moves the ledger). A node that stopped without finishing
(SIGTERM, a crash: it is expected back) is waited for until the membership forgets it (ten times
its claim's timeout without a word). :func:`final_model_lines` is what the master prints then:
where the final model is, and the command that exports it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from diloco_lightning.master.membership import Membership

__all__ = ["run_over", "final_model_lines"]


def run_over(membership: Membership, ledger: Mapping[str, int],
             refused: Callable[[str, int], bool] = lambda node, step: False,
             min_nodes: int = 1) -> dict[str, int | None] | None:
    """``{node: its last local_step}`` when the membership knows at least ``min_nodes`` nodes (a run
    of known size: a worker that has not claimed its id yet is not forgotten), each has finished, and
    each one's last delta is applied (``ledger``) or ``refused(node, local_step)``; None while the
    run goes on."""
    nodes = membership.nodes
    if len(nodes) < max(1, min_nodes):
        return None
    out: dict[str, int | None] = {}
    for node_id, st in sorted(nodes.items()):
        if not st.finished:
            return None
        step = st.finished_step
        if step is not None and ledger.get(node_id, -1) < step and not refused(node_id, step):
            return None
        out[node_id] = step
    return out


def final_model_lines(done: Mapping[str, int | None], outer_step: int, where: str, url: str) -> list[str]:
    """What the master says when the run is over: the nodes, the final version, and how to export it."""
    nodes = ", ".join(f"{n} (last delta {s})" if s is not None else f"{n} (no delta)" for n, s in done.items())
    return [
        f"every worker finished and its last delta is applied: {nodes}",
        f"the final model is global version {outer_step} on {where}; export it to a plain safetensors file with:",
        f"    diloco-export hub.url={url} out=./final_model",
    ]
