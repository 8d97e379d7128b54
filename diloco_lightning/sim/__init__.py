"""The in-process simulator: K workers' inner loops and the master's own code in one process.

:class:`Simulator` (the event queue on a simulated clock, the staleness it imposes),
:class:`SimMaster` (the product's gate, checks, round mean and outer optimizers, no hub),
:class:`SimWorker` / :class:`InnerLoop` (a worker's phases, any model), :class:`SimOptions`.
``train.py launch=sim`` builds them from a recipe (:mod:`diloco_lightning.app.sim`); a script can
build them around any model (docs/simulator.md).
"""

from diloco_lightning.sim.engine import SimResult, Simulator, as_received
from diloco_lightning.sim.inner import PRECISIONS, InnerLoop, SimWorker
from diloco_lightning.sim.master import SimMaster
from diloco_lightning.sim.options import DELAY_PER, SimOptions

__all__ = ["DELAY_PER", "PRECISIONS", "InnerLoop", "SimMaster", "SimOptions", "SimResult", "SimWorker", "Simulator",
           "as_received"]
