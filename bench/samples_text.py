"""False surprise outliers on several kinds of real text: ``python -m bench samples --text [--json] [--quick]``.

The issue's set-up (a user's own loop): a byte-level ``GPT2LMHeadModel`` (3 layers, d_model 128, dropout
0.1 on), 4 micro-batches of 8 × 128 bytes, AdamW with a linear warm-up then cosine decay, clipping at 1.0,
gradloc attached at its default ``SampleConfig``. Every sample is a random window of one of four kinds of
text that exist offline on the machine (nothing is downloaded):

- ``prose``: the docstrings of Python's standard library;
- ``legal``: Debian's licence texts in ``/usr/share/common-licenses`` (URLs, ``____`` and ``====`` lines);
- ``code``: the standard library's Python sources;
- ``markup``: man pages (groff, ``/usr/share/man/man*``), HTML and markdown under ``/usr/share/doc``.

Each evaluation step, with probability ``fault_rate``, one random sample is made a fault (kinds take turns;
trained on, as in a real run): ``random_ids`` (random bytes), ``shifted_labels_5`` (each label is the token
5 positions later), ``shifted_labels_1`` (the labels are the inputs). A fault is *detected* when its own
(micro-batch, sample) is a ``surprise`` outlier of its step, and *first* when it is the step's first outlier
(the highest z). Every other flagged sample is a *false outlier*, counted per kind of text, per 1,000 judged
samples of that kind.
"""
from __future__ import annotations

import gzip
import math
import os
import sysconfig
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench import torch_threads
from bench.natural import LICENSES, StepBatch, license_texts, stdlib_docstrings, token_losses

KINDS = ("prose", "legal", "code", "markup")
TEXT_FAULTS = ("random_ids", "shifted_labels_5", "shifted_labels_1")
EOS = 256  # byte-level: ids 0–255 are bytes, 256 ends a document


def _python_sources(limit: int) -> list[str]:
    root, out, size = sysconfig.get_paths()["stdlib"], [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in {"test", "tests", "site-packages", "__pycache__",
                                                               "idlelib", "turtledemo"})
        for name in sorted(filenames):
            if name.endswith(".py") and size < limit:
                try:
                    text = Path(dirpath, name).read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                out.append(text)
                size += len(text)
    return out


def _markup(limit: int) -> list[str]:
    """English man pages (groff) and the HTML / markdown files under /usr/share/doc, alternating, up to ``limit``."""
    man = sorted(p for d in sorted(Path("/usr/share/man").glob("man[1-8]")) for p in d.glob("*.gz"))
    doc = sorted(p for p in Path("/usr/share/doc").rglob("*") if p.suffix in (".html", ".md") and p.is_file())
    out, size = [], 0
    for i in range(max(len(man), len(doc))):
        for paths in (man, doc):
            if i < len(paths) and size < limit and not paths[i].is_symlink():
                try:
                    raw = gzip.decompress(paths[i].read_bytes()) if paths[i].suffix == ".gz" else paths[i].read_bytes()
                    text = raw.decode("utf-8")
                except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
                    continue
                out.append(text)
                size += len(text)
    return out


def text_corpus(limit: int = 1_500_000) -> dict[str, torch.Tensor]:
    """Per kind: one byte stream (documents joined with EOS), at most ``limit`` characters of each."""
    docs = {"prose": stdlib_docstrings(), "legal": license_texts() if LICENSES.is_dir() else [],
            "code": _python_sources(limit), "markup": _markup(limit)}
    out = {}
    for kind, texts in docs.items():
        ids: list[int] = []
        for t in texts:
            if len(ids) >= limit:
                break
            ids += list(t.encode("utf-8")) + [EOS]
        if len(ids) > 10_000:
            out[kind] = torch.tensor(ids, dtype=torch.long)
    return out


def decode(ids: list[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class TextConfig:
    burn_in: int = 150
    eval_steps: int = 350
    fault_rate: float = 0.5
    micro_batches: int = 4
    batch: int = 8
    seq: int = 128
    d_model: int = 128
    n_layers: int = 3
    dropout: float = 0.1
    lr: float = 2e-3
    lr_warmup: int = 50
    seed: int = 0
    threads: int | None = 1

    @staticmethod
    def quick() -> "TextConfig":
        return TextConfig(burn_in=100, eval_steps=60)

    def lr_at(self, step: int) -> float:
        if step < self.lr_warmup:
            return self.lr * (step + 1) / self.lr_warmup
        p = min(1.0, (step - self.lr_warmup) / max(1, self.burn_in + self.eval_steps - self.lr_warmup))
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def _model(cfg: TextConfig) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(cfg.seed)
    m = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=EOS + 1, n_embd=cfg.d_model, n_layer=cfg.n_layers, n_head=4,
                                         n_positions=cfg.seq, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                                         attn_pdrop=cfg.dropout, bos_token_id=EOS, eos_token_id=EOS))
    m.train()
    return m


def _batch(cfg: TextConfig, corpus: dict[str, torch.Tensor], step: int) -> tuple[StepBatch, list[list[str]]]:
    """Step ``step``'s data (the same whatever happened before) and the kind of text of every sample."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    kinds = list(corpus)
    M, B, L = cfg.micro_batches, cfg.batch, cfg.seq + 1
    pick = torch.randint(0, len(kinds), (M * B,), generator=gen).tolist()
    rows = []
    for k in pick:
        s = corpus[kinds[k]]
        at = int(torch.randint(0, len(s) - L, (1,), generator=gen))
        rows.append(s[at:at + L])
    w = torch.stack(rows).view(M, B, L)  # (M·B, T + 1) -> (M, B, T + 1)
    ids = [[f"s{step}-{m}-{b}" for b in range(B)] for m in range(M)]
    names = [[kinds[pick[m * B + b]] for b in range(B)] for m in range(M)]
    return StepBatch(w.clone(), torch.ones(M, B, cfg.seq), ids), names


def _fault(kind: str, batch: StepBatch, gen: torch.Generator) -> tuple[int, int]:
    M, B, T = batch.weights.shape
    mb, b = int(torch.randint(0, M, (1,), generator=gen)), int(torch.randint(0, B, (1,), generator=gen))
    w = batch.windows[mb]  # (B, T + 1)
    if kind == "random_ids":
        w[b] = torch.randint(0, 256, (T + 1,), generator=gen)
    elif kind == "shifted_labels_5":
        for t in range(T):
            batch.label_override[(mb, b, t)] = int(w[b, (t + 6) % (T + 1)])
    elif kind == "shifted_labels_1":
        batch.shifted.add((mb, b))
    else:
        raise ValueError(f"unknown fault {kind!r}")
    return mb, b


def run_text(cfg: TextConfig, progress: Any = None, packs: list | None = None) -> dict[str, Any]:
    """The benchmark; ``packs``: when given, each step's (host pack, kinds, fault) is appended (for replays)."""
    import gradloc

    torch_threads(cfg.threads)
    corpus = text_corpus()
    model = _model(cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95))
    mon = gradloc.watch(model, opt, job="text-kinds", embedded=False, update_ratio="off", max_overhead=None,
                        decode=decode)
    pending: list = []
    if packs is not None:
        judge = mon.samples.judge
        inner = judge.judge

        def spy(host, metas, where, dec):  # type: ignore[no-untyped-def]
            pending.append(host.copy())
            return inner(host, metas, where, dec)

        judge.judge = spy
    gen = torch.Generator().manual_seed(7)
    judged, false = Counter(), Counter()
    injected, detected, first = Counter(), Counter(), Counter()
    zs: dict[str, list[float]] = {k: [] for k in TEXT_FAULTS}
    examples: list[dict[str, Any]] = []
    burn = Counter()
    t0 = time.time()
    for step in range(cfg.burn_in + cfg.eval_steps):
        batch, names = _batch(cfg, corpus, step)
        fault, kind = None, None
        if step >= cfg.burn_in and float(torch.rand((), generator=gen)) < cfg.fault_rate:
            kind = TEXT_FAULTS[sum(injected.values()) % len(TEXT_FAULTS)]
            fault = _fault(kind, batch, gen)
            injected[kind] += 1
        for g in opt.param_groups:
            g["lr"] = cfg.lr_at(step)
        n = batch.weights.numel()

        def loss_for(i: int, mask: torch.Tensor | None = None) -> torch.Tensor:
            w = batch.weights[i] if mask is None else batch.weights[i] * mask
            return (token_losses(model(input_ids=batch.inputs(i)).logits, batch.targets(i)) * w).sum() / n

        total = torch.zeros(())
        for i in range(cfg.micro_batches):
            with mon.micro_batch(batch.targets(i), sample_ids=batch.sample_ids[i]):
                loss = loss_for(i)
                loss.backward()
            total += loss.detach()
        report = mon.end_step(total, probe=loss_for)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if pending:
            packs.append((pending.pop(), names, fault, kind, batch.windows.clone()))
        s = report.record.samples
        if s is None or not s.z_counts:
            continue
        found = [o for o in s.outliers if o.kind == "surprise"]
        keys = [(o.micro_batch, o.sample) for o in found]
        if step < cfg.burn_in:
            burn["judged"] += s.judged
            burn["flagged"] += s.flagged
            continue
        for m in range(cfg.micro_batches):
            for b in range(cfg.batch):
                if (m, b) != fault:
                    judged[names[m][b]] += 1  # a sample below min_tokens would be over-counted: none is (T = 128)
        if fault is not None and fault in keys:
            detected[kind] += 1
            first[kind] += keys[0] == fault
            zs[kind].append(round(found[keys.index(fault)].z, 1))
        for o, key in zip(found, keys):
            if key != fault:
                false[names[key[0]][key[1]]] += 1
                if len(examples) < 12:
                    examples.append(dict(step=step, kind=names[key[0]][key[1]], z=round(o.z, 1),
                                         score=round(o.score, 2), baseline=round(o.baseline, 2),
                                         span=[o.start, o.end], text=o.text))
        false["(not recorded)"] += max(0, s.flagged - len(s.outliers))
        if progress and step % 50 == 0:
            progress(step, cfg.burn_in + cfg.eval_steps, f"false {dict(false)}, detected {dict(detected)}")
    mon.close()
    per_kind = {k: {"judged": judged[k], "false": false[k],
                    "per_1000": round(1000 * false[k] / judged[k], 2) if judged[k] else None} for k in corpus}
    faults = {k: {"injected": injected[k], "detected": detected[k], "first": first[k],
                  "rate": round(detected[k] / injected[k], 3) if injected[k] else None,
                  "z_median": sorted(zs[k])[len(zs[k]) // 2] if zs[k] else None} for k in TEXT_FAULTS}
    total_judged = sum(judged.values())
    return {"config": asdict(cfg), "seconds": round(time.time() - t0, 1), "corpus": {k: len(v) for k, v in corpus.items()},
            "kinds": per_kind, "false_outliers": sum(false.values()), "judged": total_judged,
            "false_per_1000": round(1000 * sum(false.values()) / total_judged, 2) if total_judged else None,
            "faults": faults, "burn_in": dict(burn), "false_examples": examples}


def report(out: dict[str, Any]) -> str:
    c = out["config"]
    lines = [f"byte-level GPT-2, {c['n_layers']} layers, dropout {c['dropout']}, {c['burn_in']} burn-in + "
             f"{c['eval_steps']} steps ({out['seconds']} s); burn-in: {out['burn_in']}"]
    for k, v in out["kinds"].items():
        lines.append(f"  {k:8s} false outliers {v['false']:3d} in {v['judged']:6d} judged ({v['per_1000']} per 1,000)")
    for k, v in out["faults"].items():
        lines.append(f"  {k:18s} detected {v['detected']:3d}/{v['injected']:3d} (first on its step {v['first']})"
                     f"  median z {v['z_median']}")
    lines.append(f"  all: {out['false_outliers']} false in {out['judged']} judged ({out['false_per_1000']} per 1,000)")
    return "\n".join(lines)
