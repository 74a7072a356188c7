"""Integrations with training loops gradloc does not own. Each module imports its framework on import, and
each framework is an optional extra: ``transformers``/``trl``/``accelerate`` need ``gradloc[hf]`` (and
``gradloc[trl]``), ``lightning`` needs ``gradloc[lightning]``. ``loop.py`` is what they share (no framework)."""
