"""Grafana dashboards and Prometheus alert rules for gradloc's metrics (docs/grafana.md).

Bundled: five dashboards generated from code (``dashboards.py``, built from ``panels.py``: overview,
layers, tokens & incidents, RL, agent health), the Prometheus alerting and recording rules
(``rules.yml``), and ``provision.py``, which writes them with a Grafana datasource and dashboard
provider into a directory a stock Grafana container mounts (``gradloc-agent grafana provision DIR``;
``gradloc-agent grafana export NAME`` prints one dashboard).
"""
