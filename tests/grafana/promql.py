"""Every PromQL expression the dashboards use, with Grafana's variables substituted as a user's
"All" selection would (the same text the tests parse with promtool and run against Prometheus)."""
from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from gradloc.grafana.dashboards import DASHBOARDS

SUBSTITUTE = {"$__rate_interval": "1m", "$__range": "1h", "$__interval": "15s", '"$job"': '".*"',
              '"$rank"': '".*"', '"$layer"': '".*"'}


def substitute(expr: str) -> str:
    for var, value in SUBSTITUTE.items():
        expr = expr.replace(var, value)
    assert "$" not in expr.replace("$labels", ""), f"unsubstituted variable in {expr!r}"
    return expr


def queries() -> Iterator[tuple[str, str, str]]:
    """(dashboard uid, panel title, expression) of every panel target and annotation."""
    for build in DASHBOARDS.values():
        dash = build()
        for panel in dash["panels"]:
            for target in panel["targets"]:
                yield dash["uid"], panel["title"], substitute(target["expr"])
        for ann in dash["annotations"]["list"]:
            if "expr" in ann:
                yield dash["uid"], f"annotation {ann['name']}", substitute(ann["expr"])


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(gradloc_[a-z0-9_]+)\b", expr))


def as_rule_file(exprs: list[str]) -> dict[str, Any]:
    return {"groups": [{"name": "dashboards", "rules": [{"record": f"gradloc_check:q{i}", "expr": e}
                                                         for i, e in enumerate(exprs)]}]}


def provisioned(value: str, env: dict[str, str] | None = None) -> str:
    """A provisioning file's string as Grafana reads it: ``$$`` is ``$``; ``$VAR`` and ``${VAR}`` come from
    Grafana's environment, "" when unset (pkg/services/provisioning/values)."""
    return re.sub(r"\$\$|\$\{([^}]*)\}|\$(\w+)",
                  lambda m: "$" if m[0] == "$$" else (env or {}).get(m[1] or m[2], ""), value)
