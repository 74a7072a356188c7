"""Benchmarks for gradloc: ``python -m bench overhead|localization [--json] [--quick]``.

See docs/BENCHMARKS.md for what each one measures and the numbers measured on this machine.
"""
