from gradloc.localizer.localizer import Localizer, StoredGradient
from gradloc.localizer.probes import ProbeFn, ProbeSession
from gradloc.localizer.token_view import TokenView

__all__ = ["Localizer", "StoredGradient", "ProbeFn", "ProbeSession", "TokenView"]
