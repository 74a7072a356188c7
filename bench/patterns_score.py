"""The scoring of ``python -m bench patterns`` (bench/patterns.py): what the store says against the ground truth.

- **ranking**: ``patterns.from_store(...).of("source")`` — do the faulty sources hold the top places by
  (culprit spans + outliers) per million tokens?
- **flags**: every stored surprise outlier and every culprit span of every stored incident, followed back by its
  origin: it must name the row the loop fed at that (step, micro-batch, sample) (*fed*: provenance survived the
  collator, the monitor, the wire and the store) and :func:`~bench.patterns_data.resolve` must read that row's
  bytes back from the named file and line (*resolves*); it is a true flag when the row is faulty.
- **quarantine**: the store's list against the faulty rows (recall, and clean rows quarantined);
- **live**: :class:`Draws`, gradloc's judgement of every draw as the loop saw it (each step's ``StepReport``);
- :func:`total` pools the seeds; :func:`format_table` is the human table. The restart epoch is run and counted in
  bench/patterns.py (``restart``).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any


def count(values: Iterable[str]) -> dict[str, int]:
    return dict(sorted(Counter(values).items()))


def _ranking(store: Any, job: str, faulty: tuple[str, ...]) -> dict[str, Any]:
    from gradloc.agent import patterns

    rows = patterns.from_store(store, job=job).of("source")
    rate = {r.name: r.per_million if r.per_million is not None else -1.0 for r in rows}
    clean = [v for k, v in rate.items() if k not in faulty]
    first = all(k in rate for k in faulty) and min(rate[k] for k in faulty) > max(clean, default=-1.0)
    return {"order": [r.name for r in rows], "faulty_first": first,  # strictly above every clean source: no tie
            "sources": {r.name: {"per_million": None if r.per_million is None else round(r.per_million, 1),
                                 "culprits": r.culprits, "outliers": r.outliers, "tokens": r.tokens,
                                 "samples": r.samples} for r in rows}}


def flags_of(store: Any, job: str) -> list[tuple[str, int, int, int, str | None, str | None, float | None]]:
    """Every flag of the job: (what, step, micro-batch, sample, source, origin, z)."""
    out = []
    for o in store.list_outliers(job=job, kind="surprise", limit=None):
        info = o.sample_info
        out.append(("outlier", o.step, o.micro_batch, o.sample, info and info.source, info and info.origin, o.z))
    for inc in store.iter_incidents(job=job):
        for rs in inc.spans:
            s, info = rs.span, rs.span.sample_info
            out.append(("culprit", inc.step, s.micro_batch, s.sample, info and info.source, info and info.origin, None))
    return out


def findings(db: str, job: str, mix: Any, fed: dict[tuple[int, int, int], str], seq: int) -> dict[str, Any]:
    """Ranking, flags and quarantine of the measured phase (module docstring)."""
    from bench.patterns_data import resolve
    from gradloc.store.sqlite import IncidentStore

    sources = mix.origins
    with IncidentStore(db) as store:
        ranking = _ranking(store, job, mix.faulty_sources)
        flags = flags_of(store, job)
        held = store.quarantine.list(job=job)
        incidents = sum(1 for _ in store.iter_incidents(job=job))
    clean = {o: b for rows in mix.rows.values() for o, b in rows}
    checked: dict[str, bytes | None] = {}
    by_what: dict[str, Counter[str]] = {"outlier": Counter(), "culprit": Counter()}
    z_true, z_false = [], []
    for what, step, mb, sample, source, origin, z in flags:
        c = by_what[what]
        c["flags"] += 1
        if origin is None:
            c["no_origin"] += 1
            continue
        if origin not in checked:
            checked[origin] = resolve(source or "", origin, seq + 1)
        c["fed"] += fed.get((step, mb, sample)) == origin
        c["resolves"] += origin in clean and checked[origin] == clean[origin] and sources[origin] == source
        true = origin in mix.faults
        c["true"] += true
        if z is not None:
            (z_true if true else z_false).append(round(z, 1))
    flagged = {o for *_, o, _ in flags if o is not None}
    q_origins = {e.value for e in held if e.kind == "origin"}
    caught = {o for o in mix.faults if o in q_origins}
    kinds = count(mix.faults.values())
    return {"ranking": ranking, "incidents": incidents,
            "flags": {w: dict(c) for w, c in by_what.items()},
            "flagged_rows": {"faulty": len(flagged & set(mix.faults)), "clean": len(flagged - set(mix.faults))},
            "z": {"faulty_median": _median(z_true), "clean": sorted(z_false)[-10:]},
            "quarantine": {"entries": len(held), "by_kind": count(e.kind for e in held),
                           "faulty": len(caught), "faulty_total": len(mix.faults),
                           "recall": round(len(caught) / len(mix.faults), 3) if mix.faults else None,
                           "clean": len((q_origins & set(sources)) - set(mix.faults)),
                           "unknown": len([e for e in held if e.kind != "origin" or e.value not in sources]),
                           "by_fault": {k: sum(1 for o in caught if mix.faults[o] == k) for k in kinds},
                           "missed": sorted(f"{mix.faults[o]} {o}" for o in set(mix.faults) - caught)[:12]}}


def _median(xs: list[float]) -> float | None:
    return sorted(xs)[len(xs) // 2] if xs else None


class Draws:
    """What the loop fed where, and gradloc's live judgement of every draw (from each step's ``StepReport``): per
    fault kind, the draws judged after the judge's warm-up and those flagged; clean draws judged and flagged."""

    def __init__(self, faults: dict[str, str]) -> None:
        self.faults = faults
        self.fed: dict[tuple[int, int, int], str] = {}  # (step, micro-batch, sample) -> the origin fed there
        self.judged: Counter[str] = Counter()
        self.flagged: Counter[str] = Counter()
        self.z: dict[str, list[float]] = {}

    def note(self, report: Any, micro: list) -> None:
        step, s = report.record.step, report.record.samples
        judged = s is not None and bool(s.z_counts)  # empty during the judge's warm-up
        hits = {(o.micro_batch, o.sample): o.z for o in (s.outliers if s is not None else ()) if o.kind == "surprise"}
        for m, (_, _, _, infos) in enumerate(micro):
            for b, info in enumerate(infos):
                self.fed[(step, m, b)] = info.origin
                kind = self.faults.get(info.origin, "clean")
                if judged:
                    self.judged[kind] += 1
                    if (m, b) in hits:
                        self.flagged[kind] += 1
                        self.z.setdefault(kind, []).append(round(hits[(m, b)], 1))

    def summary(self) -> dict[str, dict[str, Any]]:
        return {k: {"judged": n, "flagged": self.flagged[k], "rate": round(self.flagged[k] / n, 3),
                    "z_median": _median(self.z.get(k, []))} for k, n in sorted(self.judged.items())}


def total(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The seeds together: every target, pooled."""
    flags, q, rs, by_fault, faults, live = Counter(), Counter(), Counter(), Counter(), Counter(), {}
    looks, by_fault_all = Counter(), Counter()  # the look-alikes the restart added; gradloc's flags and them
    for r in runs:
        for c in r["flags"].values():
            flags.update(c)
        q.update({k: r["quarantine"][k] for k in ("faulty", "faulty_total", "clean", "entries")})
        rs.update({k: r["restart"][k] for k in ("quarantined_rows", "quarantined_drawn", "clean_expected",
                                                 "clean_drawn", "faulty_drawn", "drawn_outside", "flags",
                                                 "flags_on_faulty")})
        rs.update({"skipped": sum(r["restart"]["skipped"].values()),
                   "judged": sum(v["judged"] for v in r["restart"]["live"].values())})
        by_fault.update(r["quarantine"]["by_fault"])
        la = r["restart"]["lookalikes"]
        looks.update({"added": la["added"], "faulty": la["faulty"], "clean": la["clean"]})
        by_fault_all.update(r["quarantine"]["by_fault"])
        by_fault_all.update(la["by_fault"])
        faults.update(r["faults_by_kind"])
        for k, v in r["live"].items():
            acc = live.setdefault(k, Counter())
            acc.update({"judged": v["judged"], "flagged": v["flagged"]})
    return {"seeds": len(runs), "faulty_first": sum(r["ranking"]["faulty_first"] for r in runs),
            "flags": dict(flags), "precision": round(flags["true"] / flags["flags"], 3) if flags["flags"] else None,
            "quarantine": dict(q), "recall": round(q["faulty"] / q["faulty_total"], 3) if q["faulty_total"] else None,
            "recall_by_fault": {k: f"{by_fault[k]}/{n}" for k, n in sorted(faults.items())},
            "lookalikes": dict(looks),  # the end: gradloc's quarantine and the rows that look like it
            "recall_with_lookalikes": round((q["faulty"] + looks["faulty"]) / q["faulty_total"], 3)
            if q["faulty_total"] else None,
            "recall_by_fault_with_lookalikes": {k: f"{by_fault_all[k]}/{n}" for k, n in sorted(faults.items())},
            "live": {k: {**v, "rate": round(v["flagged"] / v["judged"], 3) if v["judged"] else None}
                     for k, v in sorted(live.items())},
            "restart": dict(rs)}


def format_table(out: dict[str, Any]) -> str:
    c, t = out["config"], out["total"]
    lines = [f"{t['seeds']} seed(s): 4 sources × {c['rows_per_source']} rows, {c['fault_rate']:.0%} of a faulty source's "
             f"rows faulty; {c['pretrain_steps']} pre-training steps, {c['epochs']} measured epochs, 1 after the "
             f"restart ({out['seconds']} s)", "",
             "| seed | faulty | per M tokens (rank) | faulty first | flags: fed / resolves / faulty | quarantined: "
             "faulty / clean | look-alikes: faulty / clean | restart: quarantined drawn · clean drawn / expected · "
             "skipped |", "|---" * 8 + "|"]
    for r in out["runs"]:
        rk, q, rs = r["ranking"], r["quarantine"], r["restart"]
        f = Counter()
        for v in r["flags"].values():
            f.update(v)
        rates = ", ".join(f"{n} {rk['sources'][n]['per_million']}" for n in rk["order"])
        lines.append(f"| {r['seed']} | {'+'.join(r['faulty_sources'])} ({r['faulty_rows']} rows) | {rates} | "
                     f"{rk['faulty_first']} | {f['flags']}: {f['fed']} / {f['resolves']} / {f['true']} | "
                     f"{q['faulty']}/{q['faulty_total']} / {q['clean']} | {rs['lookalikes']['faulty']} / "
                     f"{rs['lookalikes']['clean']} | {rs['quarantined_drawn']} · "
                     f"{rs['clean_drawn']}/{rs['clean_expected']} · {sum(rs['skipped'].values())} |")
    f, q, rs = t["flags"], t["quarantine"], t["restart"]
    lines += ["", f"faulty sources first on {t['faulty_first']}/{t['seeds']} seeds; flags {f.get('flags', 0)}, "
                  f"{f.get('fed', 0)} name the row fed, {f.get('resolves', 0)} resolve to their file and line, "
                  f"{f.get('true', 0)} faulty (precision {t['precision']})",
              f"quarantined {q['faulty']}/{q['faulty_total']} faulty rows (recall {t['recall']}; by fault "
              f"{t['recall_by_fault']}), {q['clean']} clean; with the {t['lookalikes'].get('added', 0)} look-alikes "
              f"({t['lookalikes'].get('clean', 0)} clean): {q['faulty'] + t['lookalikes'].get('faulty', 0)}/"
              f"{q['faulty_total']} (recall {t['recall_with_lookalikes']}; by fault "
              f"{t['recall_by_fault_with_lookalikes']})",
              "judged draws flagged live: " + ", ".join(f"{k} {v['flagged']}/{v['judged']}" for k, v in t["live"].items()),
              f"restart: {rs['quarantined_drawn']} quarantined rows drawn, clean {rs['clean_drawn']}/"
              f"{rs['clean_expected']}, the sampler skipped {rs['skipped']}; {rs['flags']} flags in {rs['judged']} judged draws "
              f"({rs['flags_on_faulty']} on faulty rows left in)"]
    return "\n".join(lines)
