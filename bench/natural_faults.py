"""Faults on ``bench/natural.py``'s data: :func:`inject` turns one random sample of a step into a fault
(:data:`FAULTS`), the way real data breaks (a repeated tail, another script, binary garbage, shifted labels) or as
a planted control (one token or label)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from bench.natural import NaturalCorpus, StepBatch

FAULTS = ("planted_token", "planted_label", "repeated_tail", "foreign_script", "random_ids", "shifted_labels")
# The demo's planted RL token: weight 300 in a step of 896 loss tokens (gradloc/demo/run.py). A
# planted token here gets the same share of the step's loss weight.
PLANT_SHARE = 300 / 896
# Letters of scripts the corpus (English) hardly contains, for foreign-script documents.
_SCRIPTS = {"cyrillic": (0x430, 0x44F), "greek": (0x3B1, 0x3C9), "cjk": (0x4E00, 0x4FFF),
            "arabic": (0x627, 0x64A), "devanagari": (0x915, 0x939)}


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    micro_batch: int
    sample: int
    sample_id: str
    detail: str = ""


def foreign_text(gen: torch.Generator, words: int = 60) -> tuple[str, str]:
    """(script name, text): random words of letters from a script English text hardly uses."""
    names = sorted(_SCRIPTS)
    script = names[int(torch.randint(0, len(names), (1,), generator=gen))]
    lo, hi = _SCRIPTS[script]
    out = []
    for _ in range(words):
        n = int(torch.randint(2, 8, (1,), generator=gen))
        out.append("".join(chr(int(c)) for c in torch.randint(lo, hi + 1, (n,), generator=gen)))
    return script, " ".join(out)


def inject(kind: str, batch: StepBatch, gen: torch.Generator, model: nn.Module, corpus: NaturalCorpus,
           step: int) -> Fault:
    """Make one random sample of ``batch`` (in place) a ``kind`` fault:

    - ``planted_token``: the sample's least likely target (from the second quarter on) gets loss
      weight :data:`PLANT_SHARE` × the step's loss tokens (the demo's RL plant, same relative size);
    - ``planted_label``: where the model is surest, the target becomes the token it finds least
      likely (the demo's corrupted label; one position, weight 1);
    - ``repeated_tail``: the second half of the sample is one token repeated (a token of the sample);
    - ``foreign_script``: the sample is text in another script (random words; Cyrillic, Greek, CJK,
      Arabic or Devanagari letters), tokenized by the corpus's BPE;
    - ``random_ids``: the sample is uniformly random ids (binary garbage);
    - ``shifted_labels``: the sample's targets are its inputs (an off-by-one label shift).
    """
    if kind not in FAULTS:
        raise ValueError(f"kind must be one of {FAULTS}, got {kind!r}")
    M, B, T = batch.weights.shape
    mb = int(torch.randint(0, M, (1,), generator=gen))
    b = int(torch.randint(0, B, (1,), generator=gen))
    w = batch.windows[mb]  # (B, T + 1)
    detail = ""
    if kind in ("planted_token", "planted_label"):
        x, y = batch.inputs(mb), batch.targets(mb)
        with torch.no_grad():
            logp = torch.log_softmax(model(x[b : b + 1])[0].float(), dim=-1)  # (T, V)
        lo = T // 4
        if kind == "planted_token":
            t = lo + int(logp[lo:].gather(1, y[b, lo:, None]).squeeze(1).argmin())
            batch.weights[mb, b, t] = PLANT_SHARE * batch.weights.numel()
            detail = f"position {t}, weight {PLANT_SHARE * batch.weights.numel():.0f}"
        else:
            t = lo + int(logp[lo:].max(dim=-1).values.argmax())
            batch.label_override[(mb, b, t)] = int(logp[t].argmin())
            detail = f"position {t}"
    elif kind == "repeated_tail":
        tok = int(w[b, int(torch.randint(0, T // 2, (1,), generator=gen))])
        w[b, T // 2 :] = tok
        detail = f"token {tok}"
    elif kind == "foreign_script":
        script, text = foreign_text(gen)
        ids = corpus.encode(text)
        while len(ids) < T + 1:
            ids = ids + ids
        w[b] = torch.tensor(ids[: T + 1])
        detail = script
    elif kind == "random_ids":
        w[b] = torch.randint(0, corpus.vocab, (T + 1,), generator=gen)
    else:  # shifted_labels
        batch.shifted.add((mb, b))
    return Fault(kind, step, mb, b, batch.sample_ids[mb][b], detail)


__all__ = ["FAULTS", "PLANT_SHARE", "Fault", "foreign_text", "inject"]
