"""Integration tests: real servers (Prometheus, HTTP) in subprocesses; marked ``integration``."""
