"""A GRPO run for ``python -m bench precursors``: a policy trained on its own samples until its entropy collapses
(or, the control, not), gradloc attached with the RL fields, every step's record kept like the other runs'.

The task is small and real, on :mod:`bench.natural`'s corpus: a prompt is a random window of ``prompt`` ids, the
policy (a small HF causal LM from initialization, :func:`bench.natural.build_model`) samples ``group`` responses of
``response`` ids to each (multinomial at temperature 1, no cache: the model is tiny), and a response's reward is
the share of its ids that start a word (byte-level BPE tokens beginning with a space): ~half at initialization,
1 for a policy that only starts words. GRPO (Shao et al. 2024): each response's advantage is its reward's distance
from its group's mean over the group's standard deviation (+1e-6), every response token shares it; one update per
batch, so the ratio to the sampling policy is 1 and nothing is clipped; the loss is −Σ ratio · A over response
tokens / their count, with an optional entropy bonus. The RL fields go to ``mon.rl_fields`` (log-probs, the
sampling-time log-probs as the rollout's, advantages, ratio, per-token entropy of the full distribution), so
``rl_entropy`` and ``rl_kl_rollout`` are the monitor's own series. What the failure is (grad-spike incidents; the
loss of a policy-gradient step is no health measure and is not judged) is bench/precursors_score.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from bench.natural import Watched, build_model, natural_corpus


@dataclass(frozen=True)
class GrpoConfig:
    """``lr`` rising exponentially to ``lr_end`` over the run (None: constant); ``entropy_bonus``: the coefficient
    of the mean token entropy subtracted from the loss (the usual guard against a collapse; 0: none)."""

    family: str = "qwen3"
    seed: int = 0
    steps: int = 3000
    prompts: int = 4  # prompts per step
    group: int = 8  # responses per prompt
    prompt: int = 8  # ids per prompt
    response: int = 8  # ids per response
    micro_batches: int = 2
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    vocab: int = 2048
    lr: float = 1e-4
    lr_end: float | None = None
    entropy_bonus: float = 0.0
    clip: float = 1.0

    def __post_init__(self) -> None:
        if (self.prompts * self.group) % self.micro_batches:
            raise ValueError(f"prompts × group ({self.prompts * self.group}) must split into {self.micro_batches} "
                             "micro-batches")
        if min(self.steps, self.prompts, self.group, self.prompt, self.response) < 1 or self.group < 2:
            raise ValueError("steps, prompts, prompt and response must be >= 1 and group >= 2")

    def lr_at(self, step: int) -> float:
        if self.lr_end is None:
            return self.lr
        return self.lr * (self.lr_end / self.lr) ** (step / max(1, self.steps - 1))


class GrpoRun(Watched):
    """One GRPO run with gradloc watching (``watch``: WatchConfig fields); ``step()`` returns the StepReport."""

    judge_loss = False  # a policy-gradient loss says nothing of health: the failure is the incidents'

    def __init__(self, cfg: GrpoConfig, **watch: Any) -> None:
        import gradloc

        self.cfg = cfg
        self.corpus = natural_corpus(cfg.vocab)
        self.model = build_model(cfg.family, self.corpus.vocab, cfg.prompt + cfg.response, cfg.d_model,
                                 cfg.n_layers, cfg.n_heads, seed=cfg.seed)
        vocab = self.corpus.tokenizer.get_vocab()
        starts = [i for tok, i in vocab.items() if tok.startswith("Ġ")]  # byte-level BPE's space
        self.word_start = torch.zeros(self.corpus.vocab, dtype=torch.bool)
        self.word_start[starts] = True
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        kw = {"job": f"grpo-{cfg.family}-{cfg.seed}", "embedded": False, "update_ratio": "off", "max_overhead": None,
              **watch}
        self.mon = gradloc.watch(self.model, self.opt, **kw)
        self.step_no = 0
        self.rewards: list[float] = []
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # the last step's rewards and advantages (N,)

    @torch.no_grad()
    def sample(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, prompt + response) ids, N = prompts × group (each prompt repeated ``group`` times), and the sampling
        log-probs of the response ids (N, response)."""
        c = self.cfg
        prompts, _ = self.corpus.windows(gen, c.prompts, c.prompt)  # (P, prompt)
        seq = prompts.repeat_interleave(c.group, dim=0)  # (P, prompt) -> (P·G, prompt)
        logps = []
        for _ in range(c.response):
            logits = self.model.hf(input_ids=seq, logits_to_keep=1).logits[:, -1].float()  # (N, 1, V) -> (N, V)
            logp = torch.log_softmax(logits, dim=-1)
            nxt = torch.multinomial(logp.exp(), 1, generator=gen)  # (N, 1)
            logps.append(logp.gather(1, nxt))
            seq = torch.cat([seq, nxt], dim=1)
        return seq, torch.cat(logps, dim=1)

    def step(self) -> Any:
        c = self.cfg
        gen = torch.Generator().manual_seed(c.seed * 1_000_003 + self.step_no)
        seq, rollout = self.sample(gen)
        n, L = seq.shape
        reward = self.word_start[seq[:, c.prompt:]].float().mean(dim=1)  # (N,)
        grouped = reward.view(c.prompts, c.group)  # (N,) -> (P, G)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(n)  # (N,)
        self.rewards.append(float(reward.mean()))
        self._last = (reward, adv)
        inputs, targets = seq[:, :-1], seq[:, 1:]  # (N, L − 1) each: position t predicts id t + 1
        mask = torch.zeros(n, L - 1)
        mask[:, c.prompt - 1:] = 1.0  # the response's ids
        roll = torch.zeros(n, L - 1)
        roll[:, c.prompt - 1:] = rollout
        per = n // c.micro_batches
        count = float(mask.sum())
        for g in self.opt.param_groups:
            g["lr"] = c.lr_at(self.step_no)

        def loss_for(i: int, keep: torch.Tensor | None = None, fields: bool = False) -> torch.Tensor:
            rows = slice(i * per, (i + 1) * per)
            logits = self.model(inputs[rows]).float()  # (B, T, V)
            logp_all = torch.log_softmax(logits, dim=-1)
            logp = logp_all.gather(-1, targets[rows, :, None])[..., 0]  # (B, T)
            entropy = -(logp_all.exp() * logp_all).sum(-1)  # (B, T)
            a = adv[rows, None].expand_as(logp)  # (B,) -> (B, T)
            ratio = torch.exp(logp - logp.detach())  # 1: one update per batch
            m = mask[rows] if keep is None else mask[rows] * keep
            loss = -(ratio * a * m).sum() / count - c.entropy_bonus * (entropy * m).sum() / count
            if fields:
                self.mon.rl_fields(logp=logp.detach(), old_logp=logp.detach(), rollout_logp=roll[rows],
                                   advantages=a, ratio=ratio.detach(), clipped=torch.zeros_like(m, dtype=torch.bool),
                                   entropy=entropy.detach())
            return loss

        total = torch.zeros(())
        for i in range(c.micro_batches):
            rows = slice(i * per, (i + 1) * per)
            ids = [f"g{self.step_no}-{r}" for r in range(rows.start, rows.stop)]  # step, response
            with self.mon.micro_batch(targets[rows], loss_mask=mask[rows].bool(), sample_ids=ids):
                loss = loss_for(i, fields=True)
                loss.backward()
            total += loss.detach()
        return self.finish(total, loss_for)

    def describe(self, sample_id: str) -> dict[str, Any]:
        """The last step's response ``sample_id`` ("g<step>-<r>"): its reward and advantage, its group's rewards,
        and how its |advantage| ranks among the step's (1: the largest) — what an incident's culprit was."""
        reward, adv = self._last
        r = int(sample_id.rsplit("-", 1)[1])
        g = r // self.cfg.group
        rank = int((adv.abs() > adv[r].abs()).sum()) + 1
        return dict(reward=round(float(reward[r]), 3), advantage=round(float(adv[r]), 3), abs_advantage_rank=rank,
                    group_rewards=[round(float(x), 3) for x in reward[g * self.cfg.group:(g + 1) * self.cfg.group]],
                    zero_advantage_share=round(float((adv.abs() < 1e-3).float().mean()), 3))


__all__ = ["GrpoConfig", "GrpoRun"]
