from gradloc.adapters.pytorch import Monitor, StepReport, watch

__all__ = ["Monitor", "StepReport", "watch"]
