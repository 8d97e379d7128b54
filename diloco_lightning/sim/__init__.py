"""The in-process simulator: K workers' inner loops and the master's own code in one process.

:class:`Simulator` (the event queue on a simulated clock, the staleness it imposes),
:class:`SimMaster` (the product's gate, checks, round mean and outer optimizers, no hub),
:class:`SimWorker` / :class:`InnerLoop` (a worker's phases, any model), :class:`SimOptions`.
``train.py launch=sim`` builds them from a recipe (:mod:`diloco_lightning.app.sim`); a script can
build them around any model (docs/simulator.md).
"""

from typing import TYPE_CHECKING

from diloco_lightning.util.lazy import lazy_exports

if TYPE_CHECKING:  # the names, for type checkers; at run time each is imported on first use
    from diloco_lightning.sim.engine import SimResult
    from diloco_lightning.sim.engine import Simulator
    from diloco_lightning.sim.engine import as_received
    from diloco_lightning.sim.options import PRECISIONS
    from diloco_lightning.sim.inner import InnerLoop
    from diloco_lightning.sim.inner import SimWorker
    from diloco_lightning.sim.master import SimMaster
    from diloco_lightning.sim.options import DELAY_PER
    from diloco_lightning.sim.options import SimOptions

__getattr__, __dir__ = lazy_exports(__name__, {
    'SimResult': 'diloco_lightning.sim.engine',
    'Simulator': 'diloco_lightning.sim.engine',
    'as_received': 'diloco_lightning.sim.engine',
    'PRECISIONS': 'diloco_lightning.sim.options',
    'InnerLoop': 'diloco_lightning.sim.inner',
    'SimWorker': 'diloco_lightning.sim.inner',
    'SimMaster': 'diloco_lightning.sim.master',
    'DELAY_PER': 'diloco_lightning.sim.options',
    'SimOptions': 'diloco_lightning.sim.options',
})

__all__ = ["DELAY_PER", "PRECISIONS", "InnerLoop", "SimMaster", "SimOptions", "SimResult", "SimWorker", "Simulator",
           "as_received"]
