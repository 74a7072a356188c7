"""GradlocCallback on a real ``lightning.pytorch.Trainer`` (``accelerator="cpu"``): gradient accumulation,
clipping, bf16 autocast, what it cannot serve; DDP in tests/integrations/distributed/test_lightning_ddp.py.

The model: the tiny pre-trained HF Llama of tests/tiny_llama.py in a LightningModule (tests/integrations/
lit_llama.py). The planted culprit, as in the HF Trainer tests: in one row of step ``K`` the input token at
``POS`` is ``Z``, a byte the corpus never has (a corrupted token). Nothing is mocked.
"""
from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("lightning")

from gradloc.config import DetectorConfig  # noqa: E402
from gradloc.errors import ConfigError  # noqa: E402
from gradloc.integrations.lightning import GradlocCallback  # noqa: E402
from tests.helpers import single_thread  # noqa: E402,F401 (autouse fixture)
from tests.integrations.lit_llama import LitLlama, fit  # noqa: E402
from tests.tiny_llama import World, pretrained, rows  # noqa: E402

B, GA = 4, 2
K, MB, ROW, POS = 12, 1, 2, 17  # planted: step K, micro-batch MB, row ROW, input index POS
STEPS = K + 3
UID0 = 1000
CLIP = 1e-6  # below every healthy norm here: Lightning clips at every step
PLANTED = (K * GA + MB) * B + ROW  # the loader feeds rows in order


def config(**kw) -> dict:
    return dict(job="lightning-test", store=False, detector=DetectorConfig(warmup=8), **kw)


@pytest.fixture(scope="module")
def world() -> World:
    return pretrained(60)


@pytest.fixture(scope="module")
def data(world: World) -> list[dict]:
    return rows(world, STEPS * GA * B, plant_row=PLANTED, pos=POS, uid0=UID0)


def run(world: World, data: list[dict], callback: GradlocCallback | None, module: LitLlama | None = None,
        **kw) -> tuple[LitLlama, object]:
    module = module or LitLlama(world)
    settings = dict(max_steps=STEPS, accumulate_grad_batches=GA, gradient_clip_val=CLIP)
    settings.update(kw)
    trainer = fit(module, data, B, [callback] if callback else [], **settings)
    return module, trainer


def check_planted(cb: GradlocCallback, mon) -> None:
    assert cb.degraded is None and cb.driver is None  # closed at fit end
    assert not mon.counters, mon.counters
    assert [i.step for i in mon.incidents] == [K], [(i.step, i.spike.kinds) for i in mon.incidents]
    loc = mon.incidents[0].localization
    assert loc.status == "located" and 1 <= loc.probes <= 3, loc
    top = loc.culprits[0]
    assert (top.micro_batch, top.sample, top.sample_id) == (MB, ROW, str(UID0 + PLANTED))
    assert POS - 1 in {c.position for c in loc.culprits}  # logits position POS - 1 scores the garbage token
    assert {c.position for c in loc.culprits} <= {POS - 1, POS}
    assert loc.explained_share > 0.9


@pytest.fixture(scope="module")
def watched(world, data):
    cb = GradlocCallback(config())
    module, trainer = run(world, data, cb)
    return cb, cb.monitor, module, trainer


def test_a_planted_token_is_localized_with_accumulation_and_clipping(watched):
    cb, mon, _, trainer = watched
    check_planted(cb, mon)
    assert len(mon.history) == STEPS and trainer.global_step == STEPS
    rec = next(r for r in mon.history if r.step == K)
    assert rec.micro_batches == GA


def test_parameters_bitwise_identical_and_the_norm_is_pre_clip(watched, world, data):
    _, mon, module, _ = watched
    assert mon.incidents[0].localization.probes >= 1  # probes ran inside optimizer.step's closure
    norms: list[float] = []

    class PreClip(pytest.importorskip("lightning.pytorch").Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in pl_module.parameters()])))

    plain, _ = run(world, data, PreClip())
    for (name, p0), (_, p1) in zip(plain.named_parameters(), module.named_parameters(), strict=True):
        assert torch.equal(p0, p1), name
    assert min(norms) > 10 * CLIP  # clipping was active at every step
    assert [r.global_norm for r in mon.history] == pytest.approx(norms, rel=1e-5)  # gradloc saw the unclipped norm


def test_bf16_autocast_localizes(world, data):
    cb = GradlocCallback(config())
    run(world, data, cb, precision="bf16-mixed")
    mon = cb.monitor
    assert [i.step for i in mon.incidents] == [K]
    loc = mon.incidents[0].localization
    assert loc.status == "located" and 1 <= loc.probes <= 3, loc
    assert (loc.culprits[0].micro_batch, loc.culprits[0].sample) == (MB, ROW)


def test_without_the_probe_hook_it_says_so_and_attributes_without_probes(world, data, caplog):
    cb = GradlocCallback(config())
    with caplog.at_level(logging.WARNING, logger="gradloc"):
        run(world, data, cb, module=LitLlama(world, probe_hook=False))
    assert "no gradloc_token_loss" in caplog.text and "gradloc_token_loss" in cb.degraded
    mon = cb.monitor
    assert [i.step for i in mon.incidents] == [K]
    loc = mon.incidents[0].localization
    assert loc.probes == 0 and loc.status != "located"  # nothing verified is called located
    assert (loc.culprits[0].micro_batch, loc.culprits[0].sample) == (MB, ROW)  # the attribution still points at it


def test_manual_optimization_is_said_at_fit_start_and_keeps_per_layer_statistics(world, data, caplog):
    cb = GradlocCallback(config())
    with caplog.at_level(logging.WARNING, logger="gradloc"):
        module, _ = run(world, data[:8 * B], cb, module=LitLlama(world, manual=True), max_steps=8,
                        accumulate_grad_batches=1, gradient_clip_val=None)
    assert "manual optimization" in caplog.text and "per-layer statistics only" in cb.degraded
    mon = cb.monitor
    assert mon.hooks is None and len(mon.history) == 8  # one record per opt.step(), per-layer statistics
    assert all(r.global_norm > 0 and r.layers for r in mon.history)
    plain, _ = run(world, data[:8 * B], None, module=LitLlama(world, manual=True), max_steps=8,
                   accumulate_grad_batches=1, gradient_clip_val=None)
    assert all(torch.equal(p0, p1) for p0, p1 in zip(plain.parameters(), module.parameters(), strict=True))


def test_a_bad_config_fails_at_construction():
    with pytest.raises(ConfigError, match="unknown WatchConfig"):
        GradlocCallback({"no_such_field": 1})
    with pytest.raises(ConfigError, match="leave the callback out"):
        GradlocCallback(False)


def test_deepspeed_strategy_is_said_at_fit_start_and_gradloc_stays_off(world, caplog):
    import lightning.pytorch as pl

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="deepspeed", logger=False)  # not fitted
    cb = GradlocCallback(config())
    with caplog.at_level(logging.WARNING, logger="gradloc"):
        cb.on_fit_start(trainer, LitLlama(world))
    assert "DeepSpeedStrategy" in caplog.text and "gradloc is off for this fit" in cb.degraded
    cb.on_train_batch_start(trainer, None, {}, 0)  # nothing attaches, nothing raises
    assert cb.driver is None and cb.monitor is None


class _FrozenLlama(LitLlama):
    """The LitLlama at learning rate 0: its statistics move only where the test moves them."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.0)


def test_a_drift_finding_through_lightning_names_the_layer_and_its_samples(world):
    """From optimizer step ``start`` on, layer 1's query projection grows ×1.1 a step (its attention logits grow, as
    in a run without qk-norm): the drift detector (short warm-up, configured as a dict) names that layer, and its
    drivers are the loader's own uids."""
    import lightning.pytorch as pl

    steps, start = 40, 24

    class GrowQuery(pl.Callback):
        def __init__(self) -> None:
            self.seen = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            if trainer.global_step > self.seen:  # an optimizer step was taken
                self.seen = trainer.global_step
                if self.seen >= start:
                    with torch.no_grad():
                        pl_module.model.model.layers[1].self_attn.q_proj.weight.mul_(1.1)

    drift = dict(warmup=0, reference=16, window=8, patience=3, z_threshold=3.0, min_change=1.2)
    cb = GradlocCallback(config(token_stats=False, precursors=dict(drift=drift)))
    module = _FrozenLlama(world)
    fit(module, rows(world, steps * GA * B, uid0=UID0), B, [cb, GrowQuery()], max_steps=steps,
        accumulate_grad_batches=GA)
    found = [f for rec in cb.monitor.history for f in rec.precursor_findings]
    rising = [f for f in found if f.statistic == "attn_max_logit"]
    layer = "model.model.layers.1.self_attn"  # the LightningModule's names: its HF model is its ``model``
    assert rising and {f.layer for f in rising} == {layer}, found
    first = rising[0]
    assert start < first.step <= start + 12 and first.since_step >= start - 1, first
    assert first.drivers and {d.sample_id for d in first.drivers} <= {str(UID0 + i) for i in range(steps * GA * B)}
    assert all(x.layer == layer for x in found if x.statistic.startswith("attn_")), found
