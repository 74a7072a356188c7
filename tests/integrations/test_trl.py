"""GradlocGRPOTrainer on a real ``trl.GRPOTrainer`` (CPU, offline, no vLLM): a planted stale token
is localized and classified, probes use each loss type's normalization, training is bitwise
unchanged, and the logged metrics never see a probe.

Setup, all built at run time: a byte-level BPE tokenizer, a random-initialised 2-layer
``LlamaForCausalLM`` (hidden 32), prompts of 2–4 words (so TRL left-pads them), 2 completions of
up to 8 tokens per prompt, and a smooth synthetic reward (the mean of ``ord(c) % 7 / 7`` over the
completion's characters). ``GA = 2`` micro-batches per step and ``num_iterations = 2``: TRL then
computes ``old_per_token_logps`` (GA is not a multiple of steps_per_generation × num_iterations), and
trains each generation batch twice. TRL's defaults otherwise (``loss_type="dapo"``, gradient
checkpointing on, ``max_grad_norm=1``).

The planted culprit (``_Stale``, below gradloc in the class order, so training with and without
gradloc sees it): at step ``K``, in micro-batch ``MB`` (or the next one that has one), the first
completion with a negative advantage gets one token's old log-prob lowered by 8 — a stale old
policy for that token (a rollout buffer entry recorded under a policy that gave the token e^8 less
probability). Its ratio r = e^8 ≈ 2981, and with A < 0 the loss −min(r·A, clip(r)·A) takes the
unclipped branch, so that token's gradient is ~3000× a normal one. Nothing is mocked.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from gradloc.integrations.provenance import with_provenance
from gradloc.integrations.trl import SAMPLE_IDS, GradlocGRPOMixin, GradlocGRPOTrainer
from gradloc.records import SampleInfo
from tests.helpers import single_thread  # noqa: F401 (autouse fixture)

transformers.logging.set_verbosity_error()
B, G, GA, C = 4, 2, 2, 8  # per-device batch, generations per prompt, accumulation, max completion length
K, MB = 28, 1  # planted: step K (after the detector's 25 warm-up steps), micro-batch MB
STEPS = K + 3
STALE = 8.0
WORDS = ["abc", "def", "ghi", "the", "quick", "brown", "fox"]
TIMING = re.compile(r"step_time|runtime|per_second|profiling")


@dataclass(frozen=True)
class World:
    tok: PreTrainedTokenizerFast
    config: LlamaConfig
    weights: dict[str, torch.Tensor]
    prompts: list[str]


@pytest.fixture(scope="module")
def world() -> World:
    return make_world()


def make_world() -> World:
    """The tokenizer, the policy's config and weights (seed 0), the prompts (also tests/defaults/trl_job.py's)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([" ".join(WORDS)] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    weights = {k: v.clone() for k, v in LlamaForCausalLM(config).state_dict().items()}
    prompts = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(2 + i % 3)) + f" {i}" for i in range(512)]
    return World(tok, config, weights, prompts)


def policy(w: World) -> LlamaForCausalLM:
    model = LlamaForCausalLM(w.config)
    model.load_state_dict(w.weights)
    return model


def dataset(w: World) -> Dataset:
    return Dataset.from_dict({"prompt": w.prompts, "pid": [f"p{i}" for i in range(len(w.prompts))]})


def sourced(w: World) -> Dataset:
    """The prompts with ``with_provenance``'s columns (the two module runs train on it, with and without gradloc)."""
    return with_provenance(dataset(w), source="math", where="prompts.jsonl", tags={"lang": "en"})


def reward(completions, **kwargs) -> list[float]:
    return [sum(ord(c) % 7 for c in text) / (7 * max(len(text), 1)) for text in completions]


def grpo_args(tmp: Path, steps: int = STEPS, **kw) -> GRPOConfig:
    base = dict(output_dir=str(tmp), use_vllm=False, use_cpu=True, bf16=False, report_to="none",
                per_device_train_batch_size=B, num_generations=G, max_completion_length=C,
                gradient_accumulation_steps=GA, num_iterations=2, max_steps=steps, logging_steps=1,
                save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0)
    base.update(kw)
    return GRPOConfig(**base)


GRADLOC = dict(job="grpo-test", store=False)


class _Stale(GRPOTrainer):
    """Plants the stale old log-prob (module docstring) and records where: (step, micro-batch,
    row, completion index, prompt text)."""

    planted: tuple[int, int, int, int, str] | None = None

    def _prepare_inputs(self, batch):
        out = super()._prepare_inputs(batch)
        if not self.model.training or self.planted is not None or self._step < K * GA + MB:
            return out
        adv, mask = out["advantages"], out["completion_mask"]
        rows = [r for r in range(adv.shape[0]) if adv[r] < -0.1 and mask[r].sum() >= 2]
        if rows:
            r = rows[0]
            t = int(mask[r].nonzero()[-1]) // 2
            out = dict(out)
            old = out["old_per_token_logps"].clone()
            old[r, t] -= STALE
            out["old_per_token_logps"] = old
            prompt = self.processing_class.decode(out["prompt_ids"][r][out["prompt_mask"][r].bool()])
            self.planted = (self.state.global_step, self._step % GA, r, t, prompt)
        return out


class StaleGradloc(GradlocGRPOMixin, _Stale):
    """Also records, at the planted step, where the planted token must show up: its position in
    the (B, P + C) layout (completion token t is input P + t, scored at position P - 1 + t) and text."""

    expected: tuple[int, str] | None = None

    def _gradloc_end_step(self, model):
        if self.planted is not None and self.planted[0] == self.state.global_step:
            _, mb, row, t, _ = self.planted
            part = self._gradloc_parts[mb].inputs
            completion_token = int(part["completion_ids"][row, t])
            self.expected = (part["prompt_ids"].shape[1] - 1 + t, self.processing_class.decode([completion_token]))
        super()._gradloc_end_step(model)


class _NormAtPreOptimizerStep(TrainerCallback):
    """What a callback can see: the gradient norm in ``on_pre_optimizer_step`` (after clipping)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))


@pytest.fixture(scope="module")
def gradloc_run(world: World, tmp_path_factory) -> StaleGradloc:
    trainer = StaleGradloc(model=policy(world), reward_funcs=reward, args=grpo_args(tmp_path_factory.mktemp("gl")),
                           train_dataset=sourced(world), processing_class=world.tok, gradloc=GRADLOC,
                           gradloc_sample_ids="pid")
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def plain_run(world: World, tmp_path_factory) -> _Stale:
    trainer = _Stale(model=policy(world), reward_funcs=reward, args=grpo_args(tmp_path_factory.mktemp("plain")),
                     train_dataset=sourced(world), processing_class=world.tok, callbacks=[_NormAtPreOptimizerStep()])
    trainer.train()
    return trainer


def test_stale_token_is_localized_and_classified(gradloc_run: StaleGradloc, world: World):
    mon = gradloc_run.gradloc
    assert gradloc_run.planted is not None
    step, mb, row, t, prompt = gradloc_run.planted
    assert K <= step < STEPS - 1
    assert gradloc_run.gradloc_errors == 0 and not mon.counters, mon.counters
    assert [i.step for i in mon.incidents] == [step]  # the planted step, and no false alarm
    incident = mon.incidents[0]
    loc = incident.localization
    assert loc.status == "located" and 1 <= loc.probes <= 3, loc
    assert loc.explained_share > 0.9
    top = loc.culprits[0]
    assert (top.micro_batch, top.sample) == (mb, row)
    assert (top.position, top.text) == gradloc_run.expected  # position P - 1 + t scores completion token t
    pid = f"p{world.prompts.index(prompt)}"
    assert top.sample_id in (f"{pid}:0", f"{pid}:1")  # "<dataset id>:<generation index>"
    rec = next(r for r in mon.history if r.step == step)
    assert rec.micro_batches == GA and rec.tokens.unattributed_share == 0.0  # the fused LM head is scored too
    assert top.rl is not None and top.rl.old_logp == pytest.approx(top.rl.logp - STALE, abs=1e-3)
    assert top.rl.ratio == pytest.approx(2980.96, rel=1e-3) and top.rl.clipped is False
    assert top.rl.advantage < 0 and top.rl.entropy > 0 and top.rl.rollout_logp is None  # no vLLM: no engine log-probs
    assert top.classification.kind == "stale_off_policy" and incident.classification.kind == "stale_off_policy"
    assert {c.sample for c in loc.culprits} == {row}
    assert rec.rl.max_abs_log_ratio_old == pytest.approx(STALE, abs=1e-3)


def test_the_culprit_completion_names_its_prompt_row_s_provenance(gradloc_run: StaleGradloc, world: World):
    _, mb, row, _, prompt = gradloc_run.planted
    loc = gradloc_run.gradloc.incidents[0].localization
    (info,) = {s.sample_info for s in loc.spans if (s.micro_batch, s.sample) == (mb, row)}
    assert info == SampleInfo(source="math", origin=f"prompts.jsonl:{world.prompts.index(prompt)}", tags={"lang": "en"})


def test_parameters_bitwise_identical_metrics_clean_and_norm_pre_clip(gradloc_run: StaleGradloc, plain_run: _Stale):
    assert gradloc_run.planted == plain_run.planted
    assert gradloc_run.gradloc.incidents[0].localization.probes >= 1  # probes ran on the real model
    for (name, p0), (_, p1) in zip(plain_run.model.named_parameters(), gradloc_run.model.named_parameters(),
                                   strict=True):
        assert torch.equal(p0, p1), name
    opt0, opt1 = plain_run.optimizer.state_dict()["state"], gradloc_run.optimizer.state_dict()["state"]
    assert all(torch.equal(opt0[i][k], opt1[i][k]) for i in opt0 for k in opt0[i])

    def logged(trainer):
        return [{k: v for k, v in h.items() if not TIMING.search(k)} for h in trainer.state.log_history]

    assert logged(gradloc_run) == logged(plain_run)  # every logged metric, the probed step included
    norms = [h["grad_norm"] for h in plain_run.state.log_history if "grad_norm" in h]
    assert [r.global_norm for r in gradloc_run.gradloc.history] == pytest.approx(norms, rel=1e-5)
    spike = gradloc_run.planted[0]
    assert norms[spike] > 50  # TRL's pre-clip norm, which gradloc reports too
    seen = plain_run.callback_handler.pop_callback(_NormAtPreOptimizerStep).norms
    assert len(seen) == STEPS and seen[spike] <= 1.0 + 1e-4  # a callback only ever sees the clipped gradient


class _ProbeCheck(GradlocGRPOTrainer):
    """At step 1, before gradloc's end_step, checks the probe against training on the same
    micro-batches: the full mask gives the training loss, two complementary masks give gradients
    that add up to the accumulated training gradient; probes append no metric and run no collective."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.collectives = defaultdict(int)
        for name in ("gather", "reduce", "gather_for_metrics"):
            real = getattr(self.accelerator, name)

            def counted(*a, _name=name, _real=real, **kw):
                self.collectives[_name] += 1
                return _real(*a, **kw)

            setattr(self.accelerator, name, counted)

    def _gradloc_end_step(self, model):
        if self.state.global_step == 1:
            self.checked = self._check(model)
        super()._gradloc_end_step(model)

    def _check(self, model):
        params = [p for p in model.parameters() if p.requires_grad]
        saved = [p.grad for p in params]
        train_grad = torch.cat([g.flatten() for g in saved])
        metrics = {k: len(v) for k, v in self._metrics["train"].items()}
        calls = sum(self.collectives.values())
        controller = (self.entropy_coef, self._entropy_window_stats, self._last_world_entropy)
        total_loss, halves_loss, halves_abs, halves = 0.0, 0.0, 0.0, torch.zeros_like(train_grad)
        gen = torch.Generator().manual_seed(3)
        for part in self._gradloc_parts:
            batch, seq = part.inputs["prompt_ids"].shape[0], sum(part.inputs[k].shape[1] for k in
                                                                  ("prompt_ids", "completion_ids"))
            full = torch.ones(batch, seq, dtype=torch.bool)
            total_loss += float(self.gradloc_probe_loss(model, part.inputs, full, part.num_items_in_batch,
                                                        part.ga_steps).detach())
            first = torch.rand(batch, seq, generator=gen) < 0.5
            for mask in (first, ~first):
                for p in params:
                    p.grad = None
                loss = self.gradloc_probe_loss(model, part.inputs, mask, part.num_items_in_batch, part.ga_steps)
                loss.backward()
                halves_loss += float(loss.detach())
                halves_abs += abs(float(loss.detach()))
                halves += torch.cat([p.grad.flatten() for p in params])
        for p, g in zip(params, saved):
            p.grad = g
        rel = float((halves - train_grad).norm() / train_grad.norm())
        untouched = (metrics == {k: len(v) for k, v in self._metrics["train"].items()}
                     and controller == (self.entropy_coef, self._entropy_window_stats, self._last_world_entropy))
        return (total_loss, (halves_loss, halves_abs), float(self._gradloc_loss), rel, untouched,
                sum(self.collectives.values()) - calls)


@pytest.mark.parametrize("kw", [
    dict(loss_type="dapo"), dict(loss_type="grpo"), dict(loss_type="bnpo"), dict(loss_type="dr_grpo"),
    dict(loss_type="dapo", beta=0.1), dict(loss_type="grpo", entropy_coef=0.05),
    dict(loss_type="dr_grpo", use_adaptive_entropy=True, entropy_target=9.0),
    dict(loss_type="bnpo", importance_sampling_level="sequence"),
], ids=["dapo", "grpo", "bnpo", "dr_grpo", "dapo+kl", "grpo+entropy", "dr_grpo+adaptive-entropy", "bnpo+sequence-is"])
def test_probe_uses_the_training_normalization(world: World, tmp_path: Path, kw: dict):
    model = policy(world)
    if kw.get("beta"):  # the reference model: loaded by TRL from the policy's path, a different random model
        torch.manual_seed(9)
        LlamaForCausalLM(world.config).save_pretrained(tmp_path / "ref")
        model.config._name_or_path = str(tmp_path / "ref")
    trainer = _ProbeCheck(model=model, reward_funcs=reward, args=grpo_args(tmp_path, steps=2, **kw),
                          train_dataset=dataset(world), processing_class=world.tok, gradloc=GRADLOC)
    trainer.train()
    probe_loss, (halves_loss, halves_abs), train_loss, rel, untouched, probe_collectives = trainer.checked
    assert trainer.collectives["reduce"] > 0  # training does run them (the counter works)
    assert probe_loss == pytest.approx(train_loss, rel=1e-5, abs=1e-8)  # the full mask: the training loss
    assert halves_loss == pytest.approx(train_loss, abs=1e-5 * halves_abs)  # each term counted once (float32 sums)
    assert rel < 1e-4  # and so is its gradient
    assert untouched and probe_collectives == 0  # no metric, no controller update, no collective
    if kw.get("beta"):
        assert trainer.ref_model is not None and any("kl" in h for h in trainer.state.log_history)


def test_sample_ids_name_each_prompt_and_generation(world: World, tmp_path: Path):
    """Without an id column, rows sharing "<step>:<prompt>" are the same prompt, G of them."""
    seen = []

    class Ids(GradlocGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            seen.append((self.state.global_step, out[SAMPLE_IDS], out["prompt_ids"], out["prompt_mask"]))
            return out

    Ids(model=policy(world), reward_funcs=reward, args=grpo_args(tmp_path, steps=4), train_dataset=dataset(world),
        processing_class=world.tok, gradloc=GRADLOC).train()
    assert [s for s, *_ in seen] == [0, 2]  # one generation batch per num_iterations steps
    for step, ids, prompt_ids, prompt_mask in seen:
        assert len(set(ids)) == len(ids) == B * GA
        groups = defaultdict(list)
        for i, sid in enumerate(ids):
            s, prompt, k = sid.split(":")
            assert int(s) == step and int(k) < G
            groups[prompt].append(prompt_ids[i][prompt_mask[i].bool()].tolist())
        assert all(len(rows) == G and all(r == rows[0] for r in rows) for rows in groups.values())


def test_each_completion_keeps_its_prompt_row_s_provenance_through_shuffling_and_splitting(world: World,
                                                                                          tmp_path: Path):
    """Every micro-batch the loss sees (after TRL shuffles and splits the generation batch): row i's SampleInfo is
    its prompt's row, as its sample id and its prompt tokens say."""
    seen = []

    class Infos(GradlocGRPOTrainer):
        def _gradloc_micro_batch_args(self, inputs, ids, index):
            args = super()._gradloc_micro_batch_args(inputs, ids, index)
            seen.append((args["sample_ids"], args["sample_infos"], inputs["prompt_ids"], inputs["prompt_mask"]))
            return args

    Infos(model=policy(world), reward_funcs=reward, args=grpo_args(tmp_path, steps=2), train_dataset=sourced(world),
          processing_class=world.tok, gradloc=GRADLOC, gradloc_sample_ids="pid").train()
    assert len(seen) == 2 * GA
    for ids, infos, prompt_ids, prompt_mask in seen:
        assert len(ids) == len(infos) == B
        for i, (sid, info) in enumerate(zip(ids, infos)):
            n = int(sid.split(":")[0][1:])  # "p<n>:<k>"
            assert info == SampleInfo(source="math", origin=f"prompts.jsonl:{n}", tags={"lang": "en"})
            assert world.tok.decode(prompt_ids[i][prompt_mask[i].bool()]) == world.prompts[n]
