"""``gradloc-agent``: the command-line edge. Options become configs here and nowhere else."""
from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any, Callable

import click

from gradloc.agent.escape import json_text
from gradloc.agent.grafana_cli import grafana
from gradloc.agent.incidents_cli import incidents
from gradloc.agent.outliers_cli import outliers
from gradloc.agent.patterns_cli import patterns
from gradloc.agent.precursors_cli import precursors
from gradloc.agent.quarantine_cli import quarantine
from gradloc.agent.serve_cli import serve
from gradloc.errors import ConfigError


@click.group()
@click.version_option(package_name="gradloc")
def main() -> None:
    """gradloc: locate the tokens behind a training run's gradient spikes."""


@main.command()
@click.option("--rl", is_flag=True,
              help="The RL demo: GRPO on single-digit arithmetic, rollouts sampled from the policy itself (vLLM-shaped, "
                   "through gradloc.adapters.rl.join); the planted culprit is an RL one, and incidents carry its class.")
@click.option("--packed", is_flag=True, help="With --rl: one packed row per micro-batch (cu_seqlens) instead of padded rows.")
@click.option("--seed", default=0, show_default=True, help="Seed for model, data and the planted culprit.")
@click.option("--steps", default=200, show_default=True, help="Optimizer steps to train.")
@click.option("--inject-step", default=180, show_default=True, help="Step at which the culprit is planted.")
@click.option("--inject", type=click.Choice(["advantage", "label", "mismatch", "none"]), default=None,
              help="advantage: one sampled low-probability token with a huge loss weight (RL-style; with --rl: a huge "
                   "advantage); label: one target corrupted into a token of very low probability; mismatch (--rl "
                   "only): one token's rollout log-prob 8 nats below the trainer's; none: plant nothing. "
                   "[default: advantage; with --rl: mismatch]")
@click.option("--micro-batches", type=int, default=None,
              help="Gradient-accumulation micro-batches per step. [default: 4; with --rl: 2]")
@click.option("--incidents", "incident_path", type=click.Path(dir_okay=False), default=None,
              help="Also append incidents to this JSONL file.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (planted culprits and incidents).")
@click.option("--agent", default=None, metavar="HOST:PORT",
              help="Ship records to a running `gradloc-agent serve` instead of the in-process (embedded) agent.")
@click.option("--db", "--store", "store_path", default=None, metavar="PATH|URL", envvar="GRADLOC_DB",
              help="Embedded mode: the incident store, a SQLite file or a postgresql:// URL "
                   "[default: $GRADLOC_DB or ~/.local/state/gradloc/incidents.db].")
@click.option("--metrics-address", default=None, metavar="HOST:PORT",
              help="Embedded mode: serve /metrics and /api/incidents here while training.")
@click.option("--job", default=None, help="Job name on every record (a metric label). [default: demo; with --rl: demo-rl]")
@click.option("--rank", default=0, show_default=True, help="This process's rank (run several demos as one job's ranks).")
@click.option("--world-size", default=1, show_default=True,
              help="Ranks in the job. With --backend the demo starts them itself; without, this process is one "
                   "of them (--rank) and the agent waits for the others.")
@click.option("--backend", type=click.Choice(["ddp", "fsdp", "deepspeed", "tp", "fsdp-tp", "pp"]), default=None,
              help="Start --world-size ranks of one gloo job on this machine (DDP, FSDP2 or a DeepSpeed engine; "
                   "tensor parallel × replicate, FSDP2 × tensor parallel, or 2 pipeline stages × DDP on an even "
                   "world size >= 4), plant the culprit on (data) rank 1 and localize it across the ranks.")
@click.option("--zero-stage", type=click.IntRange(0, 3), default=None,
              help="With --backend deepspeed: the ZeRO stage. [default: 2]")
@click.option("--threads", default=1, show_default=True,
              help="Torch intra-op threads (the demo model is tiny: more threads only add synchronization).")
def demo(rl: bool, packed: bool, seed: int, steps: int, inject_step: int, inject: str | None,
         micro_batches: int | None, incident_path: str | None, as_json: bool, agent: str | None,
         store_path: str | None, metrics_address: str | None, job: str | None, rank: int, world_size: int,
         backend: str | None, zero_stage: int | None, threads: int) -> None:
    """Train a small causal LM on CPU, plant a culprit, detect and localize the spike."""
    from gradloc.agent.render import demo_json
    from gradloc.demo.spawn import SpawnError  # the trainer-side demo, imported inside its command only

    given = {k: v for k, v in dict(inject=inject, micro_batches=micro_batches, job=job,
                                   zero_stage=zero_stage).items() if v is not None}
    common = dict(seed=seed, steps=steps, inject_step=inject_step, incident_path=incident_path, agent=agent,
                  store_path=store_path, metrics_address=metrics_address, rank=rank, world_size=world_size,
                  threads=threads, **given)
    try:
        cfg, run = _demo_config(rl, packed, backend, common)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from exc
    show_bar = not as_json or sys.stderr.isatty()
    with click.progressbar(length=cfg.steps, label="training", file=sys.stderr,
                           show_pos=True, hidden=not show_bar) as bar:
        try:
            result = run(cfg, on_step=lambda step, rec: bar.update(1))
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from exc
        except SpawnError as exc:  # a rank failed or the job outlived its deadline: say which, no traceback
            raise click.ClickException(str(exc)) from exc
    planted = [dataclasses.asdict(p) for p in result.planted]
    if as_json:
        click.echo(json_text(demo_json(planted, result.incidents)))
        return
    _print_demo(cfg, planted, result)
    if cfg.agent:
        click.echo(f"\nrecords and incidents shipped to the agent at {cfg.agent}")
    elif result.store_path:
        from gradloc.store.backends import redact

        where = redact(result.store_path)
        click.echo(f"\nincidents stored in {where} — `gradloc-agent incidents list --db {where}`")


def _demo_config(rl: bool, packed: bool, backend: str | None,
                 common: dict[str, Any]) -> tuple[Any, Callable[..., Any]]:
    """The demo's typed config and its runner (raises ConfigError on bad options)."""
    if common.get("zero_stage") is not None and backend != "deepspeed":
        raise ConfigError("--zero-stage needs --backend deepspeed")
    if backend is not None:
        if rl:
            raise ConfigError("--backend runs the core demo across ranks; --rl runs on one process")
        if common["rank"] != 0:
            raise ConfigError("--rank is for a demo process that is one rank of a job; --backend starts every rank")
        from gradloc.demo.dist import run_distributed_demo
        from gradloc.demo.run import DemoConfig

        return DemoConfig(backend=backend, **common), run_distributed_demo
    if rl:
        from gradloc.demo.rl import RLDemoConfig, run_rl_demo

        return RLDemoConfig(packed=packed, **common), run_rl_demo
    if packed:
        raise ConfigError("--packed needs --rl (the core demo trains on padded rows only)")
    from gradloc.demo.run import DemoConfig, run_demo

    return DemoConfig(**common), run_demo


def _print_demo(cfg, planted, result) -> None:
    from gradloc.agent.render import incident_line, incident_text

    color = sys.stdout.isatty()
    rewards = getattr(result, "rewards", None)
    if rewards:
        k = min(20, len(rewards))
        click.echo(f"GRPO on arithmetic ({'packed' if cfg.packed else 'padded'} rows): mean reward "
                   f"{sum(rewards[:k]) / k:.2f} over the first {k} steps, {sum(rewards[-k:]) / k:.2f} over the last {k}")
    for p in planted:
        tok = result.to_text([p["token_id"]]) if result.to_text else str(p["token_id"])
        where = f"rank {p['rank']} · " if getattr(cfg, "backend", None) else ""
        click.echo(f"planted ({cfg.inject}) at step {cfg.inject_step}: {where}micro-batch {p['micro_batch']} · "
                   f"sample {p['sample']} · position {p['position']} · token {tok!r}{_plant_detail(cfg)}")
    keys = {(p["rank"], p["micro_batch"], p["sample"], p["position"]) for p in planted}
    at_plant = [inc for inc in result.incidents if inc.step == cfg.inject_step and planted]
    for inc in at_plant:
        click.echo("\n" + incident_text(inc, color=color))
        found = {(inc.rank if c.rank is None else c.rank, c.micro_batch, c.sample, c.position)
                 for c in inc.localization.culprits} if inc.localization else set()
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


def _plant_detail(cfg) -> str:
    from gradloc.demo.rl import RLDemoConfig

    if not isinstance(cfg, RLDemoConfig):
        return ""
    if cfg.inject == "mismatch":
        return f" · its rollout log-prob lowered by {cfg.mismatch:g} nats: importance weight ×{math.exp(cfg.mismatch):.0f}"
    return f" · its advantage set to {cfg.advantage:g}" if cfg.inject == "advantage" else ""


incidents.add_command(outliers)
incidents.add_command(precursors)
main.add_command(incidents)
main.add_command(patterns)
main.add_command(quarantine)
main.add_command(grafana)
main.add_command(serve)

if __name__ == "__main__":  # pragma: no cover
    main()
