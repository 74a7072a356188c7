from gradloc.detector.detector import LOCALIZE, SpikeDetector

__all__ = ["LOCALIZE", "SpikeDetector"]
