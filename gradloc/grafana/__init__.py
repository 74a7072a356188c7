"""Grafana dashboards, provisioning and alert rules ship here with the exporters (issue #3).

Nothing is bundled yet: there are no metrics to chart until the Prometheus/OTLP exporters land.
"""
