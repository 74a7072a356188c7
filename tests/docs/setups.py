"""What a docs block assumes the reader already has (a model, an optimizer, a loader, a loss), built for
real from the demo's pieces, and the checks of what a block printed.

A ```python block of README.md or docs/your-model.md names its setup in an HTML comment right above it,
``<!-- docs-test: setup=NAME -->`` (``SETUPS[NAME]``), or says why it cannot run here,
``<!-- docs-test: skip (REASON) -->``. ``CHECKS[NAME]`` then judges the block's namespace and its output.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from gradloc.demo.data import cl100k_corpus
from gradloc.demo.model import GPTConfig, TinyGPT, token_losses
from gradloc.demo.run import DemoConfig, Planted, _plant
from gradloc.store import IncidentStore

# the demo's model and its planted culprit (an advantage-weighted low-probability token); the recipe's loop
# fine-tunes a model PRETRAIN plain steps into the demo's training, with the detector at its defaults
DEMO = DemoConfig(steps=60, inject_step=45)
PRETRAIN = 100


class Tokenizer:
    """What the recipe uses of a tokenizer: ``decode`` (the demo corpus's own)."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode


def training_loop(tmp: Path) -> dict[str, Any]:
    """The README recipe's names: ``model``, ``optimizer``, ``tokenizer``, ``loader`` (lists of micro-batch
    dicts: ``input_ids``, ``labels``, ``loss_mask``, ``uid``) and ``loss_fn(model, mb, token_mask=None)``,
    the demo's training (seed 0, after ``PRETRAIN`` plain steps) with its culprit planted at ``DEMO.inject_step``;
    ``planted`` lists it."""
    cfg = DEMO
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    corpus = cl100k_corpus()
    model = TinyGPT(GPTConfig(vocab=corpus.vocab, seq=cfg.seq, d_model=cfg.d_model, n_layers=cfg.n_layers))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    loss_mask = torch.ones(cfg.batch, cfg.seq, dtype=torch.bool)
    loss_mask[:, : cfg.prompt] = False  # (B, T): a prompt carries no loss
    planted: list[Planted] = []
    for _ in range(PRETRAIN):  # unwatched: the detector's warm-up then sees the steady state, not the first descent
        x, y = corpus.batch(gen, cfg.batch * cfg.micro_batches, cfg.seq)
        (token_losses(model(x), y)[:, cfg.prompt:].mean()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    def loader() -> Iterator[list[dict[str, Any]]]:
        for step in range(cfg.steps):
            batches = [corpus.batch(gen, cfg.batch, cfg.seq) for _ in range(cfg.micro_batches)]
            weights = loss_mask.float().expand(cfg.micro_batches, -1, -1).clone()  # (M, B, T) loss weights
            if step == cfg.inject_step:
                planted.append(_plant(cfg, model, batches, weights, gen))
            yield [{"input_ids": x, "labels": y, "loss_mask": loss_mask, "weights": weights[i],
                    "uid": [f"s{step}-{i}-{b}" for b in range(cfg.batch)]} for i, (x, y) in enumerate(batches)]

    def loss_fn(model: torch.nn.Module, mb: dict[str, Any], token_mask: torch.Tensor | None = None) -> torch.Tensor:
        w = mb["weights"] if token_mask is None else mb["weights"] * token_mask  # (B, T)
        return (token_losses(model(mb["input_ids"]), mb["labels"]) * w).sum() / mb["loss_mask"].sum()

    return {"torch": torch, "model": model, "optimizer": optimizer, "tokenizer": Tokenizer(corpus.to_text),
            "loader": loader(), "loss_fn": loss_fn, "planted": planted}


def check_training_loop(ns: dict[str, Any], out: str) -> None:
    """The recipe printed the demo's answer: one incident, at the planted step, naming the planted token
    (micro-batch, sample, position) at the token level with its share of ‖∇‖², within 3 probes."""
    (p,) = ns["planted"]
    lines = [line for line in out.splitlines() if line.startswith("incident ")]
    assert len(lines) == 1, out
    m = re.fullmatch(r"incident ([0-9a-f]{12}) · job sft-7b · step (\d+): located at the token level: "
                     r"micro-batch (\d+) · sample (\d+) \(id (\S+)\) · position (\d+) '.*' "
                     r"(\(\+\d+ more\) )?· (\d+\.\d)% of ‖∇‖² · ([123]) probe\(s\)", lines[0])
    assert m, lines[0]
    assert tuple(map(int, m.group(2, 3, 4, 6))) == (DEMO.inject_step, p.micro_batch, p.sample, p.position), lines[0]
    assert float(m.group(8)) > 50, lines[0]
    assert Path("incidents.jsonl").read_text().count(m.group(1)) == 1  # the id printed is the JSONL's ...
    with IncidentStore(os.environ["GRADLOC_DB"], create=False) as store:  # ... and the store's (embedded mode)
        (row,) = [r for r in store.list_incidents() if r.job == "sft-7b" and r.step == DEMO.inject_step]
    assert row.incident_id.startswith(m.group(1)), (row.incident_id, m.group(1))


def tiny_hf(tmp: Path) -> dict[str, Any]:
    """docs/your-model.md's Trainer block: ``model``, ``args`` (3 CPU steps), ``ds``, ``tok`` (the tiny
    pre-trained Llama of tests/tiny_llama.py, 1 pre-training step)."""
    from transformers import TrainingArguments

    from tests import tiny_llama

    world = tiny_llama.pretrained(steps=1)
    args = TrainingArguments(output_dir=str(tmp / "out"), use_cpu=True, report_to="none", max_steps=3,
                             per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0)
    return {"model": tiny_llama.causal_lm(world), "args": args, "ds": tiny_llama.rows(world, 8), "tok": world.tok}


def check_tiny_hf(ns: dict[str, Any], out: str) -> None:
    trainer = ns["trainer"]
    assert trainer.gradloc_errors == 0 and len(trainer.gradloc.history) == 3


def model_with_layers(tmp: Path) -> dict[str, Any]:
    """A model with ``layers`` (torchtitan's / HF's block list) and its optimizer: ``model``, ``opt``."""
    from tests import tiny_llama

    world = tiny_llama.pretrained(steps=1)
    model = tiny_llama.causal_lm(world).model  # LlamaModel: .layers
    return {"gradloc": __import__("gradloc"), "torch": torch, "model": model,
            "opt": torch.optim.AdamW(model.parameters(), lr=1e-3)}


def check_compile_whole(ns: dict[str, Any], out: str) -> None:
    assert isinstance(ns["model"], torch._dynamo.eval_frame.OptimizedModule) and ns["mon"].attached
    ns["mon"].close()


def check_compile_blocks(ns: dict[str, Any], out: str) -> None:
    assert ns["mon"].attached and all(b._compiled_call_impl is not None for b in ns["model"].layers)
    ns["mon"].close()


def one_step(tmp: Path) -> dict[str, Any]:
    """The on_spike block's given: ``model``, ``opt``, and one step's ``loss`` (backward done) and ``probe``
    on the demo's model and text (the block's ``...`` stands for the step's micro-batch blocks)."""
    cfg = DEMO
    torch.manual_seed(cfg.seed)
    corpus = cl100k_corpus()
    model = TinyGPT(GPTConfig(vocab=corpus.vocab, seq=cfg.seq, d_model=cfg.d_model, n_layers=cfg.n_layers))
    x, y = corpus.batch(torch.Generator().manual_seed(cfg.seed), cfg.batch, cfg.seq)

    def probe(i: int, token_mask: torch.Tensor) -> torch.Tensor:
        return (token_losses(model(x), y) * token_mask).mean()

    loss = token_losses(model(x), y).mean()
    loss.backward()
    return {"gradloc": __import__("gradloc"), "model": model, "opt": torch.optim.AdamW(model.parameters()),
            "loss": loss.detach(), "probe": probe}


def check_one_step(ns: dict[str, Any], out: str) -> None:
    report = ns["report"]
    assert report.record.global_norm > 0 and report.incident is None
    assert report.record.tokens is None  # on_spike: no per-token statistics on a healthy step (no hook ran)
    ns["mon"].close()


SETUPS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "training_loop": training_loop, "tiny_hf": tiny_hf, "compile_whole": model_with_layers,
    "compile_blocks": model_with_layers, "one_step": one_step}
CHECKS: dict[str, Callable[[dict[str, Any], str], None]] = {
    "training_loop": check_training_loop, "tiny_hf": check_tiny_hf, "compile_whole": check_compile_whole,
    "compile_blocks": check_compile_blocks,
    "one_step": check_one_step}
