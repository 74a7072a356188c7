"""Integrations with training frameworks. Each module imports its framework on import, and each
framework is an optional extra: ``gradloc.integrations.transformers`` needs ``gradloc[hf]``."""
