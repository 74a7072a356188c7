"""``gradloc-agent``: the command-line edge. Options become configs here and nowhere else."""
from __future__ import annotations

import dataclasses
import json
import sys

import click

from gradloc.agent.incidents_cli import incidents
from gradloc.agent.serve_cli import serve
from gradloc.errors import ConfigError


@click.group()
@click.version_option(package_name="gradloc")
def main() -> None:
    """gradloc: locate the tokens behind a training run's gradient spikes."""


@main.command()
@click.option("--seed", default=0, show_default=True, help="Seed for model, data and the planted culprit.")
@click.option("--steps", default=200, show_default=True, help="Optimizer steps to train.")
@click.option("--inject-step", default=180, show_default=True, help="Step at which the culprit is planted.")
@click.option("--inject", type=click.Choice(["advantage", "label", "none"]), default="advantage", show_default=True,
              help="advantage: one sampled low-probability token with a huge loss weight (RL-style); "
                   "label: one target corrupted into a token of very low probability; none: plant nothing.")
@click.option("--micro-batches", default=4, show_default=True, help="Gradient-accumulation micro-batches per step.")
@click.option("--incidents", "incident_path", type=click.Path(dir_okay=False), default=None,
              help="Also append incidents to this JSONL file.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (planted culprits and incidents).")
@click.option("--agent", default=None, metavar="HOST:PORT",
              help="Ship records to a running `gradloc-agent serve` instead of the in-process (embedded) agent.")
@click.option("--db", "store_path", default=None, type=click.Path(dir_okay=False), envvar="GRADLOC_DB",
              help="Embedded mode: the SQLite incident store [default: $GRADLOC_DB or ~/.local/state/gradloc/incidents.db].")
@click.option("--metrics-address", default=None, metavar="HOST:PORT",
              help="Embedded mode: serve /metrics and /api/incidents here while training.")
@click.option("--job", default="demo", show_default=True, help="Job name on every record (a metric label).")
@click.option("--rank", default=0, show_default=True, help="This process's rank (run several demos as one job's ranks).")
@click.option("--world-size", default=1, show_default=True, help="Ranks in the job; the agent waits for all of them.")
@click.option("--threads", default=1, show_default=True,
              help="Torch intra-op threads (the demo model is tiny: more threads only add synchronization).")
def demo(seed: int, steps: int, inject_step: int, inject: str, micro_batches: int,
         incident_path: str | None, as_json: bool, agent: str | None, store_path: str | None,
         metrics_address: str | None, job: str, rank: int, world_size: int, threads: int) -> None:
    """Train a small causal LM on CPU, plant a culprit, detect and localize the spike."""
    from gradloc.agent.render import demo_json
    from gradloc.demo.run import DemoConfig, run_demo

    try:
        cfg = DemoConfig(seed=seed, steps=steps, inject_step=inject_step, inject=inject,
                         micro_batches=micro_batches, incident_path=incident_path, job=job, agent=agent,
                         store_path=store_path, metrics_address=metrics_address, rank=rank,
                         world_size=world_size, threads=threads)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from exc
    show_bar = not as_json or sys.stderr.isatty()
    with click.progressbar(length=cfg.steps, label="training", file=sys.stderr,
                           show_pos=True, hidden=not show_bar) as bar:
        try:
            result = run_demo(cfg, on_step=lambda step, rec: bar.update(1))
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from exc
    planted = [dataclasses.asdict(p) for p in result.planted]
    if as_json:
        click.echo(json.dumps(demo_json(planted, result.incidents), ensure_ascii=False))
        return
    _print_demo(cfg, planted, result)
    if cfg.agent:
        click.echo(f"\nrecords and incidents shipped to the agent at {cfg.agent}")
    elif result.store_path:
        click.echo(f"\nincidents stored in {result.store_path} — `gradloc-agent incidents list --db {result.store_path}`")


def _print_demo(cfg, planted, result) -> None:
    from gradloc.agent.render import incident_line, incident_text

    color = sys.stdout.isatty()
    for p in planted:
        tok = result.to_text([p["token_id"]]) if result.to_text else str(p["token_id"])
        click.echo(f"planted ({cfg.inject}) at step {cfg.inject_step}: micro-batch {p['micro_batch']} · "
                   f"sample {p['sample']} · position {p['position']} · token {tok!r}")
    keys = {(p["micro_batch"], p["sample"], p["position"]) for p in planted}
    at_plant = [inc for inc in result.incidents if inc.step == cfg.inject_step and planted]
    for inc in at_plant:
        click.echo("\n" + incident_text(inc, color=color))
        found = {(c.micro_batch, c.sample, c.position) for c in inc.localization.culprits} if inc.localization else set()
        verdict = "found" if keys <= found else "MISSED"
        click.echo(f"  planted culprit: {verdict} ({len(found & keys)}/{len(keys)}; "
                   f"{len(found - keys)} other token(s) reported)")
    if planted and not at_plant:
        click.echo(f"\nthe planted step {cfg.inject_step} was not flagged as a spike")
    others = [inc for inc in result.incidents if inc not in at_plant]
    if others:
        click.echo(f"\n{len(others)} other incident(s) in this run (natural spikes, or the run reacting to "
                   "the planted update):")
        for inc in others:
            click.echo("  " + incident_line(inc))


main.add_command(incidents)
main.add_command(serve)

if __name__ == "__main__":  # pragma: no cover
    main()
