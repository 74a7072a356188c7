"""Precursor statistics (records/precursors.py): measure.py computes them for one call, hooks.py finds the modules
and calls it, slots.py folds a step's calls on the device, stats.py turns the host copy into records."""
