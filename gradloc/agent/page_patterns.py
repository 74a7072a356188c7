"""The incident index page's "Patterns" section: which data groups spike, per million of their tokens
(gradloc/agent/patterns.py), the top rows of each kind that has any flag."""
from __future__ import annotations

import html

from gradloc.agent.escape import visible
from gradloc.agent.patterns import KINDS, Patterns

TOP = 8  # rows per kind on the page (the CLI and /api/patterns have them all)


def _e(x: object) -> str:
    return html.escape(visible(str(x)), quote=True)


def patterns_html(p: Patterns | None) -> str:
    """The section ("" without patterns or flags): one table per kind, highest rate first."""
    if p is None or not (p.culprits or p.outliers):
        return ""
    parts = [f'<h2>Patterns</h2><p class="muted">Culprit spans and outliers per data group over '
             f"{p.incidents} incidents and {p.outliers} outliers; rate = flags per million tokens the group "
             f"contributed (gradloc-agent patterns). Position, token class and RL class have no per-step token "
             f"count: shares only.</p>"]
    for kind in KINDS:
        rows = [r for r in p.of(kind) if r.culprits or r.outliers][:TOP]
        if not rows:
            continue
        body = "".join(
            f"<tr><td>{_e(r.name)}</td><td>{'—' if r.per_million is None else f'{r.per_million:,.1f}'}</td>"
            f"<td>{r.culprits}</td><td>{r.incidents}</td><td>{r.outliers}</td><td>{100 * r.flag_share:.0f}%</td>"
            f"<td>{'—' if r.token_share is None else f'{100 * r.token_share:.0f}%'}</td></tr>" for r in rows)
        parts.append(f'<h3>by {_e(kind.replace("_", " "))}</h3><table class="patterns"><tr><th>{_e(kind)}</th>'
                     "<th>per M tokens</th><th>culprits</th><th>incidents</th><th>outliers</th><th>of flags</th>"
                     f"<th>of tokens</th></tr>{body}</table>")
    return "".join(parts)
