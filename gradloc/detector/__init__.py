from gradloc.detector.detector import INCIDENT, LOCALIZE, SpikeDetector, norm_line, opens_incident

__all__ = ["INCIDENT", "LOCALIZE", "SpikeDetector", "norm_line", "opens_incident"]
