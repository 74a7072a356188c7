"""GradlocTrainer on a real ``transformers.Trainer`` (CPU, offline): localization, GA, checkpointing,
bitwise numerics, the pre-clip norm, the probe's normalization, and bad input.

Setup, all built at run time: a byte-level BPE tokenizer trained on two of the demo's sentences, a
random-initialised 2-layer ``LlamaForCausalLM`` (hidden 64) pre-trained for 60 plain-loop steps until
it has memorised the cycle (a fine-tune starts from a trained model; the detector's 25 warm-up
steps then see the steady state, not the first descent). Samples are 24-token windows of the
cycle whose first 8 positions carry no loss (label -100, like a prompt). The planted culprit: in
one sample of step ``K`` the token at index ``POS`` of ``input_ids`` and ``labels`` is replaced by
``Z``, a byte that never occurs in the corpus (a corrupted token in the data). Logits position
``POS - 1`` scores it (the loss shifts the labels), and position ``POS`` predicts the next token
from the garbage input, so both carry the spike. Nothing is mocked.
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

from gradloc.config import DetectorConfig, WatchConfig
from gradloc.errors import BatchMetadataError, ConfigError
from gradloc.integrations.transformers import GradlocTrainer
from tests import tiny_llama
from tests.helpers import single_thread  # noqa: F401 (autouse fixture)
from tests.tiny_llama import SEQ, World, pretrained, windows

transformers.logging.set_verbosity_error()
B, GA = 4, 2
K, MB, ROW, POS = 28, 1, 2, 17  # planted: step K, micro-batch MB, row ROW, input index POS
STEPS = K + 3
UID0 = 1000  # sample k has uid UID0 + k
CLIP = 1e-6  # below every healthy norm here: clipping is active at every step


@pytest.fixture(scope="module")
def world() -> World:
    return pretrained(60)


def dataset(w: World, steps: int = STEPS, plant: bool = True, labels: bool = True) -> list[dict]:
    n = steps * B * GA
    x = windows(w.cycle, torch.randint(0, w.period, (n,), generator=torch.Generator().manual_seed(0)))
    k = planted_index()
    if plant and k < n:
        x[k, POS] = w.tok.convert_tokens_to_ids("Z")
    rows = []
    for i in range(n):
        row = dict(input_ids=x[i], attention_mask=torch.ones(SEQ, dtype=torch.long), uid=UID0 + i)
        if labels:
            row["labels"] = tiny_llama.labels(x[i])
        rows.append(row)
    return rows


def planted_index() -> int:
    return (K * GA + MB) * B + ROW  # the sequential sampler feeds samples in order


def causal_lm(w: World) -> LlamaForCausalLM:
    model = LlamaForCausalLM(w.config)
    model.load_state_dict(w.weights)
    return model


def args(tmp_path: Path, steps: int = STEPS, ga: int = GA, **kw) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=B,
                gradient_accumulation_steps=ga, max_steps=steps, learning_rate=1e-3, lr_scheduler_type="constant",
                logging_steps=1, save_strategy="no", train_sampling_strategy="sequential", max_grad_norm=CLIP,
                seed=0, disable_tqdm=True, dataloader_num_workers=0)
    base.update(kw)
    return TrainingArguments(**base)


GRADLOC = dict(job="hf-test", store=False)  # the detector and localizer at their defaults (25 warm-up steps)


def logged_norms(trainer: Trainer) -> list[float]:
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


def check_planted(trainer: GradlocTrainer, sample_id: str, counters: dict[str, int] | None = None) -> None:
    mon = trainer.gradloc
    assert trainer.gradloc_errors == 0 and dict(mon.counters) == (counters or {}), mon.counters
    assert [i.step for i in mon.incidents] == [K]  # the planted step, and no false alarm
    loc = mon.incidents[0].localization
    assert loc.status == "located" and 1 <= loc.probes <= 3, loc
    top = loc.culprits[0]
    assert (top.micro_batch, top.sample) == (MB, ROW) and top.sample_id == sample_id
    # position p of the logits scores input token p + 1: the garbage token, or the one after it
    assert {c.position for c in loc.culprits} <= {POS - 1, POS}
    assert all((c.micro_batch, c.sample) == (MB, ROW) for c in loc.culprits)
    by_pos = {c.position: c for c in loc.culprits}
    assert POS - 1 in by_pos and by_pos[POS - 1].text == "Z"
    assert loc.explained_share > 0.9


# -- runs shared by several tests -------------------------------------------------------------------
@pytest.fixture(scope="module")
def gradloc_run(world: World, tmp_path_factory) -> GradlocTrainer:
    trainer = GradlocTrainer(model=causal_lm(world), args=args(tmp_path_factory.mktemp("gl")),
                             train_dataset=dataset(world), processing_class=world.tok, gradloc=GRADLOC,
                             gradloc_sample_ids="uid")
    trainer.train()
    return trainer


class _NormAtPreOptimizerStep(TrainerCallback):
    """What a callback can see: the gradient norm in ``on_pre_optimizer_step``."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))


@pytest.fixture(scope="module")
def plain_run(world: World, tmp_path_factory) -> Trainer:
    trainer = Trainer(model=causal_lm(world), args=args(tmp_path_factory.mktemp("plain")),
                      train_dataset=dataset(world), processing_class=world.tok,
                      callbacks=[_NormAtPreOptimizerStep()])
    trainer.train()
    return trainer


def test_planted_token_is_localized_with_gradient_accumulation(gradloc_run: GradlocTrainer):
    check_planted(gradloc_run, sample_id=str(UID0 + planted_index()))
    rec = next(r for r in gradloc_run.gradloc.history if r.step == K)
    assert rec.micro_batches == GA
    logged = [h for h in gradloc_run.state.log_history if "loss" in h and "grad_norm" in h]
    assert len(gradloc_run.gradloc.history) == len(logged) == STEPS
    assert rec.loss == pytest.approx(logged[K]["loss"], rel=1e-6)  # the step loss = Σ micro-batch losses


def test_parameters_bitwise_identical_and_norm_is_pre_clip(gradloc_run: GradlocTrainer, plain_run: Trainer):
    assert gradloc_run.gradloc.incidents[0].localization.probes >= 1  # probes ran on the real model at step K
    for (name, p0), (_, p1) in zip(plain_run.model.named_parameters(), gradloc_run.model.named_parameters(),
                                   strict=True):
        assert torch.equal(p0, p1), name
    opt0, opt1 = plain_run.optimizer.state_dict()["state"], gradloc_run.optimizer.state_dict()["state"]
    assert all(torch.equal(opt0[i][k], opt1[i][k]) for i in opt0 for k in opt0[i])

    ours = [r.global_norm for r in gradloc_run.gradloc.history]
    theirs = logged_norms(plain_run)
    assert logged_norms(gradloc_run) == theirs
    assert min(theirs) > 10 * CLIP  # clipping was active at every step (post-clip norms are ≤ CLIP)
    assert ours == pytest.approx(theirs, rel=1e-5)
    # why gradloc is not a callback: the first hook after the last backward already sees clipped gradients
    seen = plain_run.callback_handler.pop_callback(_NormAtPreOptimizerStep).norms
    assert len(seen) == STEPS and max(seen) <= CLIP * (1 + 1e-3)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_localizes_the_same_token(world: World, gradloc_run: GradlocTrainer,
                                                         tmp_path: Path, reentrant: bool):
    """Also the default sample ids: without a named id column the Trainer drops ``uid`` (not a
    forward argument), and gradloc names samples ``<step>:<micro-batch>:<row>``."""
    model = causal_lm(world)
    trainer = _ExactLayers(model=model, args=args(tmp_path, activation_checkpointing=True,
                                                    activation_checkpointing_kwargs={"use_reentrant": reentrant}),
                             train_dataset=dataset(world), processing_class=world.tok, gradloc=GRADLOC)
    trainer.train()
    assert model.is_activation_checkpointing
    check_planted(trainer, sample_id=f"{K}:{MB}:{ROW}")
    assert [r.global_norm for r in trainer.gradloc.history] == pytest.approx(
        [r.global_norm for r in gradloc_run.gradloc.history], rel=1e-4)
    assert len(trainer.exact_layers) == STEPS * GA
    assert set(trainer.exact_layers) == {"lm_head"}  # the position-exact layer is not a re-run decoder layer


def test_torch_compile_localizes_the_same_token(world: World, gradloc_run: GradlocTrainer, tmp_path: Path):
    """``torch_compile=True``: the Trainer compiles the whole model (accelerate's dynamo plugin, inductor)
    before its first call; gradloc attaches on the first training step, before that call, so its
    hooks are traced into the graph (collector/compiled.py): the same token, the same norms."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    trainer = GradlocTrainer(model=causal_lm(world), args=args(tmp_path, torch_compile=True),
                             train_dataset=dataset(world), processing_class=world.tok, gradloc=GRADLOC,
                             gradloc_sample_ids="uid")
    trainer.train()
    assert trainer.gradloc_degraded is None and trainer.gradloc.hooks is not None
    assert not counters["graph_break"], dict(counters["graph_break"])
    # a compiled forward: the precursor statistics are not measured, and the monitor says so once
    check_planted(trainer, sample_id=str(UID0 + planted_index()), counters={"precursors_compiled": 1})
    assert [r.global_norm for r in trainer.gradloc.history] == pytest.approx(
        [r.global_norm for r in gradloc_run.gradloc.history], rel=1e-4)
    assert all(r.tokens.unattributed_share == 0.0 for r in list(trainer.gradloc.history)[1:])


def test_bf16_autocast_localizes(world: World, tmp_path: Path):
    """``bf16=True`` on CPU: the Trainer runs forward and loss under autocast (no GradScaler)."""
    trainer = GradlocTrainer(model=causal_lm(world), args=args(tmp_path, bf16=True), train_dataset=dataset(world),
                             processing_class=world.tok, gradloc=GRADLOC, gradloc_sample_ids="uid")
    trainer.train()
    check_planted(trainer, sample_id=str(UID0 + planted_index()))
    assert [r.global_norm for r in trainer.gradloc.history] == pytest.approx(logged_norms(trainer), rel=1e-5)


class _ExactLayers(GradlocTrainer):
    """Records each micro-batch's position-exact layer (the last watched module of the forward)."""

    def _gradloc_attach(self, model, inputs):
        super()._gradloc_attach(model, inputs)
        hooks, end = self.gradloc.hooks, self.gradloc.hooks.end
        self.exact_layers = []

        def recording_end():
            buf = end()
            self.exact_layers.append(hooks.layers[buf.last_layer])
            return buf

        hooks.end = recording_end


class _ProbeCheck(GradlocTrainer):
    """At step 1, before gradloc's end_step, checks the probe against training on the same
    micro-batches: a full mask gives the training loss, and two complementary masks give
    gradients that add up to the accumulated training gradient."""

    checked: list[tuple[float, float, float]]

    def _gradloc_end_step(self, model):
        if self.state.global_step == 1:
            self.checked = self._check(model)
        super()._gradloc_end_step(model)

    def _check(self, model):
        params = [p for p in model.parameters() if p.requires_grad]
        saved = [p.grad for p in params]
        train_grad = torch.cat([g.flatten() for g in saved])
        total_loss, halves = 0.0, torch.zeros_like(train_grad)
        for part in self._gradloc_parts:
            full = torch.ones(B, SEQ, dtype=torch.bool)
            total_loss += float(self.gradloc_probe_loss(model, part.inputs, full, part.num_items_in_batch,
                                                        part.ga_steps).detach())
            first = torch.zeros(B, SEQ, dtype=torch.bool)
            first[:, : SEQ // 2 + 3] = True
            for mask in (first, ~first):
                for p in params:
                    p.grad = None
                self.gradloc_probe_loss(model, part.inputs, mask, part.num_items_in_batch, part.ga_steps).backward()
                halves += torch.cat([p.grad.flatten() for p in params])
        for p, g in zip(params, saved):
            p.grad = g
        rel = float((halves - train_grad).norm() / train_grad.norm())
        return [(total_loss, float(self._gradloc_loss), rel)]


@pytest.mark.parametrize("num_items", [True, False], ids=["token-sum/num_items_in_batch", "per-batch-mean/GA"])
def test_probe_uses_the_training_normalization(world: World, tmp_path: Path, num_items: bool):
    trainer = _ProbeCheck(model=causal_lm(world), args=args(tmp_path, steps=2), train_dataset=dataset(world, 2),
                          processing_class=world.tok, gradloc=GRADLOC)
    if not num_items:
        trainer.model_accepts_loss_kwargs = False  # the Trainer then divides a per-micro-batch mean by GA
    trainer.train()
    (probe_loss, train_loss, rel), = trainer.checked
    assert probe_loss == pytest.approx(train_loss, rel=1e-6)
    assert rel < 1e-5


def test_no_labels_degrades_to_per_layer_statistics(world: World, tmp_path: Path, caplog):
    """A dataset without labels (the loss built in a custom compute_loss): per-layer statistics
    and detection only, with a warning; training runs to the end."""

    class OwnLoss(GradlocTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            logits = model(input_ids=inputs["input_ids"]).logits  # (B, T, V)
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), inputs["input_ids"][:, 1:].flatten())

    with caplog.at_level(logging.WARNING, logger="gradloc"):
        trainer = OwnLoss(model=causal_lm(world), args=args(tmp_path, steps=3),
                          train_dataset=dataset(world, 3, labels=False), processing_class=world.tok, gradloc=GRADLOC)
        trainer.train()
    assert "labels" in trainer.gradloc_degraded and "per-token statistics are off" in caplog.text
    hist = trainer.gradloc.history
    assert len(hist) == 3 and all(r.tokens is None and r.layers for r in hist)
    assert [r.global_norm for r in hist] == pytest.approx(logged_norms(trainer), rel=1e-5)


def test_non_causal_model_degrades_to_per_layer_statistics(world: World, tmp_path: Path):
    model = LlamaForSequenceClassification(LlamaConfig(**{**world.config.to_dict(), "num_labels": 3}))
    rows = [dict(input_ids=r["input_ids"], attention_mask=r["attention_mask"], labels=r["uid"] % 3)
            for r in dataset(world, 3, plant=False)]
    trainer = GradlocTrainer(model=model, args=args(tmp_path, steps=3), train_dataset=rows,
                             processing_class=world.tok, gradloc=GRADLOC)
    trainer.train()
    assert trainer.gradloc_degraded is not None and trainer.gradloc.hooks is None
    assert len(trainer.gradloc.history) == 3 and trainer.gradloc_errors == 0


def _collator_with_bad_ids_at(bad_batch: int):
    """Default collation, except that batch ``bad_batch`` carries one sample id too few."""
    count = [0]

    def collate(rows):
        batch = default_data_collator(rows)
        if count[0] == bad_batch:
            batch["uid"] = batch["uid"][:-1]
        count[0] += 1
        return batch

    return collate


def test_bad_sample_ids_raise_at_setup_and_are_counted_later(world: World, tmp_path: Path):
    first = GradlocTrainer(model=causal_lm(world), args=args(tmp_path, steps=3), train_dataset=dataset(world, 3),
                           data_collator=_collator_with_bad_ids_at(0), processing_class=world.tok, gradloc=GRADLOC,
                           gradloc_sample_ids="uid")
    with pytest.raises(BatchMetadataError, match="sample_ids"):
        first.train()  # the first micro-batch is setup: a typed error before any optimizer step
    later = GradlocTrainer(model=causal_lm(world), args=args(tmp_path, steps=3), train_dataset=dataset(world, 3),
                           data_collator=_collator_with_bad_ids_at(3), processing_class=world.tok, gradloc=GRADLOC,
                           gradloc_sample_ids="uid")
    later.train()  # micro-batch 1 of step 1 is left out of per-token statistics; training goes on
    assert later.gradloc.counters["integration_skipped_micro_batches"] == 1 and later.state.global_step == 3
    assert [r.micro_batches for r in later.gradloc.history] == [GA, GA - 1, GA]


def test_bad_gradloc_argument_fails_at_construction(world: World, tmp_path: Path):
    for bad in (dict(jobb="x"), "sft", dict(detector=dict(warmup=1)), dict(precursors=dict(drift=dict(window=2)))):
        with pytest.raises(ConfigError):
            GradlocTrainer(model=causal_lm(world), args=args(tmp_path), train_dataset=dataset(world, 1),
                           gradloc=bad)
    off = GradlocTrainer(model=causal_lm(world), args=args(tmp_path, steps=1), train_dataset=dataset(world, 1),
                         gradloc=False)
    off.train()
    assert off.gradloc is None
    cfg = GradlocTrainer(model=causal_lm(world), args=args(tmp_path), train_dataset=dataset(world, 1),
                         gradloc=dict(job="j", detector=dict(warmup=3))).gradloc_config
    assert cfg == WatchConfig(job="j", detector=DetectorConfig(warmup=3))
    with pytest.raises(ConfigError, match=r"gradloc\.precursors\.drift: unknown DriftConfig field\(s\) \['windw'\]"):
        GradlocTrainer(model=causal_lm(world), args=args(tmp_path), train_dataset=dataset(world, 1),
                       gradloc=dict(precursors=dict(drift=dict(windw=8))))


def test_the_trainer_s_steps_carry_the_precursor_statistics(world: World, gradloc_run: GradlocTrainer):
    """The HF Trainer's own loop (HF's sdpa attention, its loss inside the model): every attention layer, the head
    and the final norm are found by themselves and measured on every step after the first micro-batch."""
    from gradloc.records import PrecursorKind as K

    n_layers = world.config.num_hidden_layers
    for rec in list(gradloc_run.gradloc.history)[1:]:
        got = {(p.kind, p.layer) for p in rec.precursors if p.head is None}
        assert {layer for kind, layer in got if kind == K.ATTN_MAX_LOGIT} == \
            {f"model.layers.{i}.self_attn" for i in range(n_layers)}
        assert {(K.LOGIT_MAX_ABS, "lm_head"), (K.LOGIT_LSE_SQ, "lm_head"), (K.RESIDUAL_RMS, "model.norm")} <= got
    assert "precursors_swap_missed" not in gradloc_run.gradloc.counters


class _GrowQuery(TrainerCallback):
    """From optimizer step ``start`` on, layer 1's query projection grows ×1.1 after every step: its attention
    logits grow the way a run without qk-norm drifts before it fails, through the Trainer's own loop."""

    def __init__(self, model: LlamaForCausalLM, start: int) -> None:
        self.q, self.start = model.model.layers[1].self_attn.q_proj.weight, start

    def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201 - Trainer's callback signature
        if state.global_step >= self.start:
            with torch.no_grad():
                self.q.mul_(1.1)


def test_a_drift_finding_through_the_trainer_names_the_layer_and_its_samples(world: World, tmp_path: Path):
    """The drift detector at a short warm-up (its defaults wait 1,000 steps), configured as a plain dict the way an
    HF config passes it: the finding names layer 1's attention and the dataset's own sample ids as its drivers."""
    steps, start = 40, 24
    model = causal_lm(world)
    drift = dict(warmup=0, reference=16, window=8, patience=3, z_threshold=3.0, min_change=1.2)
    trainer = GradlocTrainer(model=model, args=args(tmp_path, steps=steps, learning_rate=0.0),
                             train_dataset=dataset(world, steps, plant=False), processing_class=world.tok,
                             gradloc=dict(GRADLOC, token_stats=False, precursors=dict(drift=drift)),
                             gradloc_sample_ids="uid", callbacks=[_GrowQuery(model, start)])
    trainer.train()
    found = [f for rec in trainer.gradloc.history for f in rec.precursor_findings]
    rising = [f for f in found if f.statistic == "attn_max_logit"]
    assert rising and {f.layer for f in rising} == {"model.layers.1.self_attn"}, found
    first = rising[0]
    assert start < first.step <= start + 12 and first.since_step >= start - 1, first
    uids = {str(UID0 + i) for i in range(steps * B * GA)}
    assert first.drivers and {d.sample_id for d in first.drivers} <= uids, first.drivers
    assert all(x.layer == "model.layers.1.self_attn" for x in found if x.statistic.startswith("attn_")), found
