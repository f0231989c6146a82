"""How a traced run ends other than by finishing: the types every part of the probe raises.

The runner catches them and turns each into the result's status; the virtual device, the
distributed patches and the version checks raise them. They live here, below all of those, so
that none of them imports the runner (which imports them all). Each is a ``BaseException`` so
that a script's own ``except Exception`` does not swallow it.
"""

from __future__ import annotations


class Refused(BaseException):
    """A job the probe does not estimate, for the reason given (status ``unsupported``)."""


class NotAGPUJob(Refused):
    """The script steps a model that is not on the virtual GPU (status ``not_on_gpu``)."""


class StopProbe(BaseException):
    """Raised from the optimizer hook after the last recorded step; ends the script cleanly."""
