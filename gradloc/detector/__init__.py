from gradloc.detector.detector import INCIDENT, LOCALIZE, SpikeDetector, opens_incident

__all__ = ["INCIDENT", "LOCALIZE", "SpikeDetector", "opens_incident"]
