from gradloc.localizer.localizer import Localizer, SpikeContext, StoredGradient
from gradloc.localizer.probes import ProbeFn, ProbeSession
from gradloc.localizer.token_view import TokenView

__all__ = ["Localizer", "SpikeContext", "StoredGradient", "ProbeFn", "ProbeSession", "TokenView"]
