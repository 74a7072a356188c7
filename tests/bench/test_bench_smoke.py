"""Smoke tests of the benchmarks: ``python -m bench <name> --quick --json`` as a subprocess.

Each prints exactly one JSON object on stdout; the quick runs take a few seconds on one thread.
The numbers of the full runs are in docs/BENCHMARKS.md.
"""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def needs(*modules: str) -> pytest.MarkDecorator:
    """The optional extras a benchmark mode runs on (``bench``: transformers; ``bench-peers``)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {missing}")


# A bound against a hang, not a speed check (speed belongs in bench/): the quick runs take 5-110 s on a loaded
# 2-core machine; pytest's own per-test timeout is 600 s.
TIMEOUT_S = 540


def run_bench(*args: str, timeout: float = TIMEOUT_S) -> dict:
    proc = subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True,
                          check=False, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout.strip()
    assert out.count("\n") == 0, f"expected exactly one JSON line on stdout, got:\n{out[:2000]}"
    return json.loads(out)


@needs("transformers")
def test_overhead_quick_json():
    res = run_bench("overhead", "--quick", "--json", "--threads", "1")
    assert set(res["models"]) == {"tinygpt", "llama"}  # both by default, side by side
    assert res["torch_threads"] == 1 and res["loadavg_1m"] and res["wall_s"] > 0
    for name, m in res["models"].items():
        for key in ("per_layer_ratio", "per_token_ratio", "plain_step_ms", "per_layer_step_ms", "per_token_step_ms",
                    "paired_per_token_ratio", "cpu_per_token_ratio", "rounds", "tokens_per_step", "d_model",
                    "n_layers", "params", "phases_ms"):
            assert key in m, (name, key)
        # tiny models on a possibly busy machine: only sanity, not the targets (see docs/BENCHMARKS.md)
        for key in ("per_layer_ratio", "per_token_ratio", "paired_per_token_ratio", "cpu_per_token_ratio"):
            assert math.isfinite(m[key]) and 0.5 < m[key] < 20, (name, key, m[key])
        assert m["plain_step_ms"] > 0 and m["rounds"] == 10
        assert m["updates_identical"], f"{name}: monitoring changed the optimizer update"
        assert m["identical_to_plain"] == {"per_layer": True, "per_token": True}
    llama = res["models"]["llama"]
    assert llama["model"] == "llama" and llama["kv_heads"] < llama["n_heads"] and llama["tied_embeddings"]
    assert_human_table("overhead", res)


@needs("opacus", "backpack", "wandb")
def test_overhead_peers_quick_json():
    res = run_bench("overhead", "--quick", "--json", "--peers")
    assert set(res["models"]) == {"tinygpt"}
    m = res["models"]["tinygpt"]
    assert list(m["phases_ms"]) == ["plain", "per_layer", "per_token", "opacus_ghost", "backpack_l2", "wandb_watch"]
    assert set(res["peers"]) == {"opacus_ghost", "backpack_l2", "wandb_watch"}
    for name in ("per_layer", "per_token", "opacus_ghost", "backpack_l2", "wandb_watch"):
        assert math.isfinite(m[f"{name}_ratio"]) and m[f"{name}_ratio"] > 0, name
        assert m["computes"][name], name
    assert m["updates_identical"]
    assert res["peers"]["backpack_l2"]["computes"].startswith("BackPACK")
    # BackPACK has no LayerNorm extension: the run reports which parameters it left out
    left_out = m["extra"]["backpack_l2"]["params_without_batch_l2"]
    assert left_out and all(".ln" in n or n.startswith("ln_f.") for n in left_out), left_out
    assert m["extra"]["wandb_watch"]["service_cpu_s"] >= 0


@pytest.mark.distributed
def test_overhead_ddp_quick_json():
    """Two DDP ranks (spawned, gloo): ratios on every rank, one gradloc collective per step, and the
    monitored copies' parameters equal plain's bitwise on every rank."""
    res = run_bench("overhead", "--quick", "--json", "--ddp", "2", timeout=TIMEOUT_S)
    d = res["ddp"]
    assert d["world_size"] == 2 and d["model"] == "tinygpt" and len(d["ranks"]) == 2
    assert d["job_kind"] == {"per_layer": "ddp", "per_token": "ddp"}
    assert d["collectives_per_step"] == {"per_layer": 1.0, "per_token": 1.0}
    assert d["updates_identical"] and all(all(r["identical_to_plain"].values()) for r in d["ranks"])
    assert all(r["per_token_ratio"] > 0 and r["per_layer_ratio"] > 0 for r in d["ranks"])


@pytest.mark.distributed
@pytest.mark.parametrize("mode,collectives", [("fsdp-tp", {"per_layer": 1.0, "per_token": 2.0}),
                                              ("pp", {"per_layer": 1.0, "per_token": 2.0})])
def test_overhead_parallel_quick_json(mode, collectives):
    """Four ranks of a model-parallel job (spawned, gloo): ratios on every rank, the documented collectives per
    step (the step gather; per-token adds the token group's scores), parameters equal plain's bitwise."""
    res = run_bench("overhead", "--quick", "--json", "--parallel", mode, timeout=600)
    p = res["parallel"]
    assert p["mode"] == mode and p["world_size"] == 4 and len(p["ranks"]) == 4
    assert p["collectives_per_step"] == collectives
    assert p["updates_identical"]
    assert all(r["per_token"] > 0 and r["per_layer"] > 0 for r in p["ranks"])
    assert set(p["job_ratios"]) == {"per_layer", "per_token"} and all(x > 0 for x in p["job_ratios"].values())
    for name, (lo, hi) in p["job_paired_ci95"].items():  # the paired median lies inside its own interval
        assert lo <= p["job_paired"][name] <= hi
    phases = p["rank_phases_ms"]  # per rank and variant: forward + backward, end_step, clip, optimizer
    assert len(phases) == 4 and all(len(ph["plain"]) == 4 and ph["plain"][1] == 0.0 and ph["per_layer"][1] > 0
                                    for ph in phases)
    assert p["clip"] == 1.0 and all(ph["plain"][2] > 0 for ph in phases)  # every variant clips, torchtitan's way


def test_overhead_memory_quick_json():
    res = run_bench("overhead", "--quick", "--json", "--memory", "--model", "tinygpt")
    mem = res["memory"]["tinygpt"]
    assert list(mem["variants"]) == ["plain", "per_layer", "per_token", "per_token_full", "per_token_off"]
    assert mem["param_mb"] > 0 and res["repeats"] == 1 and res["steps"] >= 2
    assert res["pinned_env"] == {"MALLOC_MMAP_THRESHOLD_": "131072"}
    for name, row in mem["variants"].items():
        for prefix in ("", "pinned_"):  # default glibc malloc; the same runs with the mmap threshold pinned
            assert row[f"{prefix}peak_rss_mb"] > 0 and row[f"{prefix}setup_rss_mb"] > 0, name
            assert row[f"{prefix}peak_rss_mb"] >= row[f"{prefix}setup_rss_mb"], name  # a high-water mark only grows
            assert math.isfinite(row[f"extra_{prefix}peak_rss_mb"])
            assert math.isfinite(row[f"extra_{prefix}peak_rss_mb_pct_params"])
            assert len(row[f"{prefix}peak_rss_mb_runs"]) == 1
    assert mem["variants"]["plain"]["extra_peak_rss_mb"] == mem["variants"]["plain"]["extra_pinned_peak_rss_mb"] == 0
    assert "cuda_peak_mb" not in mem["variants"]["plain"]  # CPU run


def test_overhead_profile_quick_json():
    res = run_bench("overhead", "--quick", "--profile", "--json", "--threads", "1")
    assert res["model"] == "tinygpt"
    fns = res["functions_ms_per_step"]
    assert set(fns) == {"per_layer", "per_token"}
    assert "Monitor.end_step (all of it)" in fns["per_layer"]
    assert any(k.startswith("LinearRule.score") for k in fns["per_token"])
    assert not any(k.startswith("LinearRule") for k in fns["per_layer"])  # no token hooks per-layer
    for name in ("attention_stats", "head_stats", "rms_stats"):  # the precursors, on by default, in both
        assert all(f"precursors.measure.{name} (forward)" in fns[v] for v in fns), (name, list(fns["per_layer"]))


def test_localization_quick_json():
    res = run_bench("localization", "--quick", "--json")
    for key in ("recall", "precision", "probes_max", "probes_median", "explained_share_min",
                "bisection_probes_median", "bisection_recall", "bisection_all_probes_median",
                "bisection_all_recall", "scenarios", "spikes"):
        assert key in res, key
    assert 0.0 <= res["recall"] <= 1.0 and 0.0 <= res["bisection_recall"] <= 1.0
    assert res["precision"] is None or 0.0 <= res["precision"] <= 1.0
    assert {r["scenario"] for r in res["scenarios"]} == {"single", "three_mb", "label", "advantage", "diffuse"}
    diffuse = res["per_scenario"]["diffuse"]
    assert diffuse["statuses"] == {"diffuse": 1} and diffuse["tokens_named"] == 0 and diffuse["probes_max"] <= 3
    assert all(r["grads_restored"] for r in res["scenarios"])
    assert res["spikes"] == len(res["scenarios"]), [r["kinds"] for r in res["scenarios"]]
    # what the quick run measured when this test was written: every planted culprit found in <= 3 probes
    assert res["recall"] == 1.0 and res["probes_max"] <= 3
    # the baseline needs a micro-batch scan plus 2 probes per split
    assert res["bisection_probes_median"] > res["probes_median"]
    assert res["bisection_all_recall"] >= res["bisection_recall"]
    assert_human_table("localization", res)


def assert_human_table(name: str, res: dict) -> None:
    """The human table (what ``python -m bench <name>`` prints without ``--json``) rendered from the JSON a quick
    run printed: the two outputs are one ``print(json.dumps(res) if args.json else format_table(res))`` apart,
    so the table is checked on the same run instead of a second identical one."""
    if name == "overhead":
        from bench.overhead import format_table
    else:
        from bench.localization_summary import format_table
    table = format_table(res)
    if name == "overhead":  # a header per model, a row per variant
        for model in res["models"]:
            assert f"{model}: d_model" in table, table
        assert table.count("\nper_token ") == len(res["models"]), table
    else:  # a row per scenario, then the three methods' summaries
        assert table.count("\n") >= len(res["scenarios"]) + 4, table
        assert "gradloc:" in table and "bisection (worst mb):" in table and "bisection (all hot mbs):" in table


@pytest.mark.parametrize("encode", ["replay", "client"])
def test_soak_quick_json(encode):
    """20 s of jobs starting and ending against a real daemon (retention 2 s): nothing dropped, every
    record accepted, and the ended jobs forgotten — during the run (fewer ranks tracked than ever
    ran) and after it (none of the soak's series left on /metrics, no job or rank tracked). Both
    load generators: records restamped by the replay client, or each encoded by the AgentClient."""
    res = run_bench("soak", "--quick", "--json", "--encode", encode, timeout=TIMEOUT_S)
    assert res["encode"] == encode
    assert res["client_drops"] == 0 and res["daemon_drops"] == 0, res["client_drop_counts"]
    assert res["records_sent"] == res["records_offered"] > 0
    assert res["records_accepted"] >= res["records_sent"]  # more only if a batch was re-sent after a lost reply
    assert res["incident_records_accepted"] >= res["incidents_sent"] > 0
    assert res["jobs_run"] > res["concurrent_jobs"]  # jobs ended and were replaced during the run
    assert res["ranks_tracked_max"] < res["jobs_run"] * res["ranks_per_job"]  # ended jobs forgotten while it ran
    assert res["drained"] and res["soak_series_after_drain"] == 0 and res["jobs_tracked_after_drain"] == 0
    assert res["series_max"] > 10 * res["series_after_drain"]  # the per-job series were there, then went
    assert 0 < res["rss_mb_after_warmup"] and 0 < res["rss_mb_end"]
    assert res["rss_windows_s"] == [[8.0, 10.0], [18.0, 20.0]]  # 40% of the 20 s run, then its last 10%
    assert len(res["timeline"]) == 20


@needs("transformers")
def test_overhead_compiled_and_moe_quick_json():
    """--compile: every variant's step through torch.compile, on_spike added, updates identical to plain;
    --model qwen3moe --on-spike: the MoE model with the on_spike variant."""
    res = run_bench("overhead", "--quick", "--json", "--compile", "--model", "tinygpt", timeout=600)
    m = res["models"]["tinygpt"]
    assert res["compiled"] is True
    assert m["identical_to_plain"] == {"per_layer": True, "per_token": True, "on_spike": True}
    assert all(math.isfinite(m[f"{v}_ratio"]) for v in ("per_layer", "per_token", "on_spike"))
    res = run_bench("overhead", "--quick", "--json", "--model", "qwen3moe", "--on-spike", timeout=600)
    m = res["models"]["qwen3moe"]
    assert m["model"] == "qwen3moe" and m["experts"] == 4 and res["compiled"] is False
    assert m["identical_to_plain"] == {"per_layer": True, "per_token": True, "on_spike": True}


def test_median_ci_order_statistics():
    """The interval is the ⌊n/2 − 0.98√n⌋-th and ⌈n/2 + 0.98√n⌉-th smallest values (1-based), clamped."""
    from bench.parallel import median_ci

    xs = [float(v) for v in range(40, 0, -1)]  # 40 values, unsorted: ranks 13 and 27 (20 ∓ 6.2)
    assert median_ci(xs) == (13.0, 27.0)
    assert median_ci([5.0]) == (5.0, 5.0)
    assert median_ci([2.0, 1.0, 3.0]) == (1.0, 3.0)  # clamped to the sample
    with pytest.raises(ValueError):
        median_ci([])
