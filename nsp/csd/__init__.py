"""Computational storage on a model clock: link figures, the three schemes of Smart-Infinity (HPCA'24) over N
devices, and the time a real store's measured traffic would take on such devices.

One module per job: ``figures`` (the links' bandwidths, cited defaults), ``clock`` (a phase's time from the bytes
it moves on each resource), ``model`` (baseline, SmartUpdate and SmartComp steps, Table I traffic), ``measured``
(a store's counted traffic on the model clock), ``paper`` (the paper's settings and published numbers), ``device``
(the options of the emulated device a ``tier="csd"`` store runs each shard on: its figures and faults),
``plan`` (``nsp plan``'s prediction; ``nsp.emulate`` runs one real update on N emulated devices beside it).
The package imports nothing of nsp outside itself: ``nsp.storage`` opens ``csd`` stores with ``device``'s options.

    >>> from nsp.csd import LinkFigures, Setting, step_time
    >>> round(step_time("smartupdate", Setting(params=1_000_000_000), 4, LinkFigures()).seconds, 1) > 0
    True
"""

from nsp.csd.clock import DeviceLoad, Phase, PhaseTime, phase_time
from nsp.csd.device import device_options, store_device_options
from nsp.csd.figures import LinkFigures
from nsp.csd.model import LABELS, SCHEMES, Setting, StepTime, best, phases, scaling, step_time, table_one, traffic

__all__ = ["LABELS", "SCHEMES", "DeviceLoad", "LinkFigures", "Phase", "PhaseTime", "Setting", "StepTime", "best",
           "device_options", "phase_time", "phases", "scaling", "step_time", "store_device_options", "table_one",
           "traffic"]
