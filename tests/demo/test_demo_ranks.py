"""``gradloc-agent demo --world-size N --backend …``: the real CLI starts the ranks itself, plants the
culprit on (data) rank 1, and the job's one incident names rank 1 (``--json``: rank on planted entries and
culprits). Data parallelism on 2 ranks; tensor, FSDP2 × tensor and pipeline parallelism on 4 (dp 2 × 2)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

AGENT = str(Path(sys.executable).with_name("gradloc-agent"))
# The plant at step 30 (the detector warms up on steps 0-25), on the run's last step: what is checked is the plant's
# step and every step's tokens, and each step after the plant cost a 4-rank run ~1.8 s on 2 cores (tp: 36 steps
# took 60 s, 31 steps 52 s).
PLANT = 30
STEPS = PLANT + 1


def _demo(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    from tests.distributed.ds_common import ENV  # DeepSpeed's shm op, built once by the ds_shm_op fixture

    env = {**os.environ, "OMP_NUM_THREADS": "1", **ENV}
    return subprocess.run([AGENT, "demo", "--db", str(tmp_path / "demo.db"), *args], capture_output=True,
                          text=True, timeout=600, env=env)


@pytest.mark.parametrize("backend", ["ddp", "fsdp", "deepspeed", "tp", "fsdp-tp", "pp"])
def test_the_demo_plants_on_rank_1_and_the_job_incident_names_it(tmp_path: Path, backend: str,
                                                                request: pytest.FixtureRequest) -> None:
    extra: tuple[str, ...] = ()
    if backend == "deepspeed":
        request.getfixturevalue("ds_shm_op")  # built once into .torch_extensions (skips without deepspeed)
        extra = ("--zero-stage", "3")
    world = "4" if backend in ("tp", "fsdp-tp", "pp") else "2"
    res = _demo(tmp_path, "--world-size", world, "--backend", backend, "--steps", str(STEPS), "--inject-step",
                str(PLANT), "--json", *extra)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    (planted,) = doc["planted"]
    assert planted["rank"] == 1
    at_plant = [i for i in doc["incidents"] if i["step"] == PLANT]
    assert len(at_plant) == 1, doc["incidents"]
    inc = at_plant[0]
    assert inc["scope"] == "job" and inc["rank"] == 0 and inc["status"] == "located" and 1 <= inc["probes"] <= 3
    top = inc["culprits"][0]
    assert {k: top[k] for k in planted} == planted
    assert all("rank" in c for c in inc["culprits"])
    if backend != "pp":  # the demo's samples carry provenance: the embedded store holds rank 0's steps (sinks.py),
        from gradloc.store.sqlite import IncidentStore  # and rank 0 counts its data index's tokens (pp: the last stage)

        with IncidentStore(tmp_path / "demo.db", create=False) as store:
            totals = {(k, n): t for k, n, _, t in store.history.group_totals()}  # this run only
        seq, prompt, batch, mbs = 64, 8, 4, 4  # the demo's defaults (gradloc/demo/run.py DemoConfig)
        assert totals[("source", "sentences")] == STEPS * mbs * batch * (seq - prompt), totals


def test_bad_combinations_are_refused_before_any_rank_starts(tmp_path: Path) -> None:
    """Each refused with exit code 2 and the reason. (The five CLI runs go at once: each spends its ~3 s importing
    torch before it refuses, and they do not share anything but the never-created store path.)"""
    from tests.distributed.ds_common import ENV

    cases = ((("--backend", "ddp"), "world_size >= 2"),
             (("--backend", "pp", "--world-size", "2"), "even world_size >= 4"),
             (("--backend", "ddp", "--world-size", "2", "--rl"), "--rl runs on one process"),
             (("--backend", "ddp", "--world-size", "2", "--rank", "1"), "--backend starts every rank"),
             (("--backend", "ddp", "--world-size", "2", "--zero-stage", "1"), "needs --backend deepspeed"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", **ENV}
    procs = [subprocess.Popen([AGENT, "demo", "--db", str(tmp_path / "demo.db"), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for args, _ in cases]
    try:
        errs = [p.communicate(timeout=600)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for (args, words), p, err in zip(cases, procs, errs):
        assert p.returncode == 2 and words in err, (args, err)
    assert not (tmp_path / "demo.db").exists()
