"""What a worker's boundary and install did (``BoundaryResult.metrics()`` flattens it for a logger)."""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco_lightning.worker.jobs import UploadReport

__all__ = ["InstallResult", "BoundaryResult"]


@dataclass
class InstallResult:
    """A global version copied into the model."""

    outer_step: int
    #: how many versions behind the newest one the worker had seen it was (0: the newest)
    staleness: int
    previous_outer_step: int | None
    seconds: float


@dataclass
class BoundaryResult:
    """What one boundary did (``metrics()`` flattens it for a logger)."""

    boundary: int
    base_outer_step: int
    outer_step: int
    installed: InstallResult | None = None
    uploads: list[UploadReport] = field(default_factory=list)
    pending_phases: int = 0
    wait_seconds: float = 0.0
    seconds: float = 0.0
    #: H of the next inner phase (Dynamic Local Updates may change it; None: the caller decides)
    inner_steps: int | None = None

    def metrics(self, prefix: str = "diloco/") -> dict[str, float]:
        m = {
            "outer_step": float(self.outer_step),
            "boundary": float(self.boundary),
            "boundary_seconds": self.seconds,
            "pending_phases": float(self.pending_phases),
        }
        if self.wait_seconds:
            m["wait_seconds"] = self.wait_seconds
        if self.inner_steps is not None:
            m["inner_steps"] = float(self.inner_steps)
        if self.installed is not None:
            m["installed_outer_step"] = float(self.installed.outer_step)
            m["install_staleness"] = float(self.installed.staleness)
            m["install_seconds"] = self.installed.seconds
        done = [u for u in self.uploads if u.ok and u.local_step is not None]
        if done:
            m["delta_norm"] = float(done[-1].delta_norm or 0.0)
            m["upload_bytes"] = float(sum(u.nbytes for u in done))
            m["upload_seconds"] = float(sum(u.seconds for u in done))
        failed = [u for u in self.uploads if not u.ok]
        if failed:
            m["upload_failures"] = float(len(failed))
        return {prefix + k: v for k, v in m.items()}
