from gradloc.detector.detector import INCIDENT, LOCALIZE, SpikeDetector

__all__ = ["INCIDENT", "LOCALIZE", "SpikeDetector"]
