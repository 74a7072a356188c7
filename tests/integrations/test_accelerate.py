"""GradlocAccelerate on a real ``accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)`` loop:
the planted corrupted token (as in the HF Trainer and Lightning tests) localized with ≤ 3 probes, parameters
bitwise those of the same loop without gradloc, the norm gradloc reports is the one before clipping, bf16
autocast, no probe hook, bad config. Nothing is mocked."""
from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from gradloc.config import DetectorConfig  # noqa: E402
from gradloc.errors import BatchMetadataError, ConfigError  # noqa: E402
from gradloc.integrations.accelerate import GradlocAccelerate, causal_lm_token_loss  # noqa: E402
from gradloc.integrations.loop import hf_view  # noqa: E402
from tests.helpers import single_thread  # noqa: E402,F401 (autouse fixture)
from tests.tiny_llama import World, causal_lm, pretrained, rows  # noqa: E402

B, GA = 4, 2
K, MB, ROW, POS = 12, 1, 2, 17  # planted: step K, micro-batch MB, row ROW, input index POS
STEPS = K + 3
UID0 = 1000
CLIP = 1e-6  # below every healthy norm: clipping is active at every step
PLANTED = (K * GA + MB) * B + ROW


@pytest.fixture(scope="module")
def world() -> World:
    return pretrained(60)


@pytest.fixture(scope="module")
def data(world: World) -> list[dict]:
    return rows(world, STEPS * GA * B, plant_row=PLANTED, pos=POS, uid0=UID0)


def token_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    return causal_lm_token_loss(model(input_ids=batch["input_ids"]).logits, batch["labels"])


def view(batch: dict) -> dict[str, Any]:
    return {**hf_view(batch), "sample_ids": [str(u) for u in batch["uid"].tolist()]}


def train(world: World, data: list[dict], gradloc: dict | None, mixed_precision: str = "no",
          probe_hook: bool = True, view_fn=view) -> tuple[torch.nn.Module, GradlocAccelerate | None, list[float]]:
    """The loop of the module docstring of gradloc/integrations/accelerate.py, with or without gradloc."""
    AcceleratorState._reset_state(True)  # a fresh Accelerator per run (its state is process-wide)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=GA, mixed_precision=mixed_precision)
    model, opt = causal_lm(world), None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(data, batch_size=B, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    gl = None
    if gradloc is not None:
        gl = GradlocAccelerate(acc, model, opt, token_loss=token_loss if probe_hook else None, view=view_fn,
                               **gradloc)
    norms: list[float] = []  # pre-clip norms as clip_grad_norm_ returns them
    for batch in loader:
        with gl.accumulate(batch) if gl else acc.accumulate(model):
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            gl.backward(loss) if gl else acc.backward(loss)
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            opt.zero_grad()
    if gl:
        gl.close()
    return acc.unwrap_model(model), gl, norms


GRADLOC = dict(job="accelerate-test", store=False, detector=DetectorConfig(warmup=8))


@pytest.fixture(scope="module")
def runs(world, data):
    return train(world, data, GRADLOC), train(world, data, None)


def test_a_planted_token_is_localized_with_accumulation(runs):
    (_, gl, norms), _ = runs
    mon = gl.monitor
    assert not mon.counters, mon.counters
    assert len(mon.history) == len(norms) == STEPS
    assert [i.step for i in mon.incidents] == [K]
    loc = mon.incidents[0].localization
    assert loc.status == "located" and 1 <= loc.probes <= 3, loc
    top = loc.culprits[0]
    assert (top.micro_batch, top.sample, top.sample_id) == (MB, ROW, str(UID0 + PLANTED))
    assert POS - 1 in {c.position for c in loc.culprits} and {c.position for c in loc.culprits} <= {POS - 1, POS}
    assert loc.explained_share > 0.9
    assert next(r for r in mon.history if r.step == K).micro_batches == GA


def test_parameters_bitwise_identical_and_the_norm_is_pre_clip(runs):
    (model, gl, norms), (plain, _, plain_norms) = runs
    for (name, p0), (_, p1) in zip(plain.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(p0, p1), name
    assert norms == plain_norms and min(norms) > 10 * CLIP  # the loop's own norms, and clipping was active
    assert [r.global_norm for r in gl.monitor.history] == pytest.approx(norms, rel=1e-5)


def test_bf16_autocast_localizes(world, data):
    _, gl, _ = train(world, data, GRADLOC, mixed_precision="bf16")
    loc = gl.monitor.incidents[0].localization
    assert [i.step for i in gl.monitor.incidents] == [K]
    assert loc.status == "located" and 1 <= loc.probes <= 3, loc
    assert (loc.culprits[0].micro_batch, loc.culprits[0].sample) == (MB, ROW)


def test_without_a_token_loss_the_attribution_runs_without_probes(world, data):
    _, gl, _ = train(world, data, GRADLOC, probe_hook=False)
    loc = gl.monitor.incidents[0].localization
    assert loc.probes == 0 and loc.status != "located"
    assert (loc.culprits[0].micro_batch, loc.culprits[0].sample) == (MB, ROW)


def test_a_batch_without_token_ids_after_setup_is_counted_and_training_goes_on(world, data):
    bad_uid = UID0 + 5 * GA * B  # the first row of step 5

    def flaky(batch: dict) -> dict | None:
        return None if bad_uid in batch["uid"].tolist() else view(batch)

    model, gl, _ = train(world, data, GRADLOC, view_fn=flaky)
    mon = gl.monitor
    assert dict(mon.counters) == {"integration_skipped_micro_batches": 1} and gl.driver.errors == 1
    assert len(mon.history) == STEPS and next(r for r in mon.history if r.step == 5).micro_batches == GA - 1
    assert [i.step for i in mon.incidents] == [K] and mon.incidents[0].localization.status == "located"
    plain, _, _ = train(world, data, None)
    assert all(torch.equal(p0, p1) for p0, p1 in zip(plain.parameters(), model.parameters(), strict=True))


def test_a_batch_without_token_ids_at_setup_raises(world, data):
    with pytest.raises(BatchMetadataError, match="no token ids"):
        train(world, data[:GA * B], GRADLOC, view_fn=lambda batch: None)


def test_a_bad_config_fails_at_construction(world):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True)
    model = acc.prepare(causal_lm(world))
    with pytest.raises(ConfigError, match="unknown WatchConfig"):
        GradlocAccelerate(acc, model, config={"no_such_field": 1})
    with pytest.raises(ConfigError):
        GradlocAccelerate(acc, model, config={"token_stats": "sometimes"})
