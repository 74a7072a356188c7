"""The engine: the :class:`~gradloc.engine.monitor.Monitor` that runs collector → detector → localizer for one
watched model and hands records to the sinks. Users reach it through ``gradloc.watch`` (gradloc/adapters/)."""
