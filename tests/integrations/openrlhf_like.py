"""An OpenRLHF 0.11-shaped stand-in for the adapter tests: OpenRLHF cannot run here (its trainers
need DeepSpeed, Ray and GPUs). Read from OpenRLHF v0.11.0 (``openrlhf/trainer/ppo_utils/experience.py``,
``samples_generator.py``, ``openrlhf/models/actor.py``, ``models/loss.py``, ``utils/loss_utils.py``,
``trainer/ray/ppo_actor.py``, ``utils/deepspeed/deepspeed.py``) and imitated here:

- :class:`Experience`: the dataclass's field names; :func:`make_experience` builds rows the way
  ``_process_response_into_experience`` + ``make_experience_batch`` do: ``sequences``/``attention_mask``
  (B, T) right-padded, ``action_mask = mask[1:T]`` (B, T − 1: action j ↔ token j + 1), per-action
  ``action_log_probs``, ``rollout_log_probs``, ``base_action_log_probs``, ``advantages``.
- :class:`Actor`: ``forward(sequences, action_mask, attention_mask=, return_output=, ring_attn_group=,
  packed_seq_lens=, return_entropy=)``: log-probs of the rolled sequences, last column dropped, last A
  kept, × action_mask; with ``packing_samples`` the attended tokens go through the model as one packed
  row (TinyGPT with ``cu_seqlens``). ``actor.model`` is the engine (:class:`Engine`, DeepSpeed's
  surface: ``backward`` scales by 1/gas, ``step`` clips and steps at the accumulation boundary,
  ``is_gradient_accumulation_boundary``, ``gradient_accumulation_steps``, ``get_global_grad_norm``),
  without ``zero_optimization_stage``: gradloc does not take it for a DeepSpeed engine and watches its
  ``module`` (real ZeRO engines: tests/integrations/distributed/test_openrlhf_zero.py). ``zero_stage=`` adds the method,
  making it DeepSpeed-shaped (only attach-time checks use that).
- :class:`PolicyLoss`: PPO clip (+ dual clip) with the TIS correction and ``aggregate_loss`` token mode
  (Σ l·m / batch_num_tokens · dp_size), written from its formulas; :class:`Trainer`: ``training_step``
  composing actor loss + kl_ctl × KL (k3) − entropy_coef × entropy and calling the strategy's
  ``backward`` and ``optimizer_step``; :func:`step_norms`: ``_optimizer_step_loss_norm`` (tokens ÷ gas).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import nn

from gradloc.demo.model import GPTConfig, TinyGPT

VOCAB = 96


@dataclass
class Experience:
    sequences: torch.Tensor = None
    attention_mask: torch.Tensor = None
    action_mask: torch.Tensor = None
    action_log_probs: torch.Tensor = None
    base_action_log_probs: torch.Tensor = None
    rollout_log_probs: torch.Tensor = None
    values: torch.Tensor = None
    returns: torch.Tensor = None
    advantages: torch.Tensor = None
    kl: torch.Tensor = None
    rewards: torch.Tensor = None
    scores: torch.Tensor = None
    response_length: torch.Tensor = None
    truncated: torch.Tensor = None
    total_length: torch.Tensor = None
    index: list = None
    prompts: list = field(default_factory=list)
    labels: list = field(default_factory=list)
    info: dict = field(default_factory=dict)


def make_experience(rows: list[tuple[list[int], list[int]]], *, advantages: list[float] | None = None,
                    truncated: list[bool] | None = None) -> Experience:
    """Rows of (prompt, response) token ids → a batched Experience (log-prob fields filled by the caller)."""
    B, T = len(rows), max(len(p) + len(r) for p, r in rows)
    seq = torch.zeros(B, T, dtype=torch.long)
    att = torch.zeros(B, T, dtype=torch.long)
    act = torch.zeros(B, T, dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        seq[i, :len(p) + len(r)] = torch.tensor(p + r)
        att[i, :len(p) + len(r)] = 1
        act[i, len(p):len(p) + len(r)] = 1  # the action range
    adv = torch.tensor(advantages or [1.0] * B)[:, None] * act[:, 1:].float()
    return Experience(sequences=seq, attention_mask=att, action_mask=act[:, 1:].bool(), advantages=adv,
                      truncated=torch.tensor(truncated or [False] * B),
                      response_length=torch.tensor([len(r) for _, r in rows]))


class Engine(nn.Module):
    """DeepSpeed engine surface (see the module docstring) around the HF-shaped model."""

    def __init__(self, module: nn.Module, optimizer, gas: int, clip: float = 1.0, zero_stage: int | None = None) -> None:
        super().__init__()
        self.module, self.optimizer, self.gas, self.clip = module, optimizer, gas, clip
        self.micro_steps, self.norms = 0, []
        if zero_stage is not None:
            self.zero_optimization_stage = lambda: zero_stage

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss):
        (loss / self.gas).backward()  # scale_wrt_gas

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gas == 0

    def gradient_accumulation_steps(self) -> int:
        return self.gas

    def step(self):
        if self.is_gradient_accumulation_boundary():
            self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)))
            self.optimizer.step()
            self.optimizer.zero_grad()
        self.micro_steps += 1

    def get_global_grad_norm(self):
        return self.norms[-1] if self.norms else None


class HFShaped(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.gpt = TinyGPT(GPTConfig(vocab=VOCAB, seq=32, d_model=32, n_layers=2, n_heads=4))

    def forward(self, input_ids, attention_mask=None, position_ids=None, cu_seqlens=None, **_):
        return {"logits": self.gpt(input_ids, cu_seqlens=cu_seqlens)}


class Out(dict):
    __getattr__ = dict.__getitem__


class Actor(nn.Module):
    def __init__(self, model: nn.Module, packing_samples: bool = False, temperature: float = 1.0) -> None:
        super().__init__()
        self.model, self.packing_samples, self.temperature = model, packing_samples, temperature

    def forward(self, sequences, action_mask=None, attention_mask=None, return_output=False, allgather_logits=False,
                return_logprobs=False, ring_attn_group=None, packed_seq_lens=None, return_entropy=False, **_):
        B, T = sequences.shape
        rolled = torch.roll(sequences, shifts=-1, dims=1)
        if self.packing_samples:
            att = attention_mask.bool()
            lens = att.sum(1)
            cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
            packed = self.model(sequences[att][None], cu_seqlens=cu)["logits"][0]  # (1, N, V) -> (N, V)
            logits = packed.new_zeros(B, T, packed.shape[-1])
            logits[att] = packed  # back to (B, T, V)
        else:
            logits = self.model(sequences)["logits"]
        output = Out(logits=logits.float())
        logp_all = torch.log_softmax(output["logits"] / self.temperature, -1)
        if return_entropy:
            output["entropy"] = -(logp_all.exp() * logp_all).sum(-1)[:, :-1]
        log_probs = logp_all.gather(-1, rolled[..., None]).squeeze(-1)[:, :-1]  # (B, T - 1)
        action_log_probs = log_probs[:, -action_mask.shape[1]:] * action_mask.float()
        return (action_log_probs, output) if return_output else action_log_probs


def aggregate_loss(loss, mask, dp_size=1, batch_num_tokens=None, global_batch_size=None):
    if batch_num_tokens is None:
        return (loss * mask).sum() / mask.sum().clamp(min=1)
    return (loss * mask).sum() / batch_num_tokens * dp_size


class PolicyLoss:
    def __init__(self, clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=None, is_threshold=None) -> None:
        self.clip_eps_low, self.clip_eps_high, self.dual_clip = clip_eps_low, clip_eps_high, dual_clip
        self.token_level_loss, self.policy_loss_type = True, "ppo"
        self.enable_vllm_is_correction = is_threshold is not None
        self.vllm_is_truncated_threshold, self.vllm_is_correction_type = is_threshold, "tis"

    def __call__(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, dp_size=1,
                 batch_num_tokens=None, global_batch_size=None):
        ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0).exp()
        surr1 = ratio * advantages
        surr2 = ratio.clamp(1 - self.clip_eps_low, 1 + self.clip_eps_high) * advantages
        loss = -torch.min(surr1, surr2)
        if self.dual_clip is not None:
            loss = -torch.where(advantages < 0, torch.max(torch.min(surr1, surr2), self.dual_clip * advantages),
                                torch.min(surr1, surr2))
        if self.enable_vllm_is_correction:
            lo, hi = self.vllm_is_truncated_threshold
            loss = torch.exp(old_log_probs - rollout_log_probs).clamp(min=lo, max=hi).detach() * loss
        out = aggregate_loss(loss, action_mask, dp_size, batch_num_tokens, global_batch_size)
        clip_ratio = ((surr2 < surr1).float() * action_mask).sum() / action_mask.sum()
        return out, clip_ratio, torch.zeros(()), None


def k3(log_probs, base):
    lr = log_probs.float() - base.float()
    return ((-lr).exp() - 1 + lr).clamp(-10, 10)


class Strategy:
    def __init__(self, gas: int) -> None:
        self.accumulated_gradient, self.ring_attn_group = gas, None

    def backward(self, loss, model, _optimizer, **kwargs):
        model.model.backward(loss)

    def optimizer_step(self, _optimizer, model, _scheduler, name="model", **kwargs):
        model.model.step()

    def get_grad_norm(self, model):
        n = model.model.get_global_grad_norm()
        return 0.0 if n is None else float(n)


class Trainer:
    """ActorPPOTrainer.training_step's composition (see the module docstring)."""

    def __init__(self, actor: Actor, gas: int, *, kl_coef: float = 0.0, entropy_coef: float | None = None,
                 is_threshold=None, packing: bool = False) -> None:
        self.actor, self.strategy = actor, Strategy(gas)
        self.actor_optim = actor.model.optimizer
        self.actor_loss_fn = PolicyLoss(is_threshold=is_threshold)
        self.aux_loss = False
        self.args = SimpleNamespace(algo=SimpleNamespace(kl=SimpleNamespace(use_loss=kl_coef > 0, init_coef=kl_coef)),
                                    actor=SimpleNamespace(entropy_coef=entropy_coef),
                                    train=SimpleNamespace(dynamic_batch_enable=False),
                                    ds=SimpleNamespace(packing_samples=packing))
        self.losses: list[float] = []

    def training_step(self, experience, kl_ctl, step, loss_batch_info=None):
        self.actor.train()
        if loss_batch_info is None:
            loss_batch_info = {"dp_size": 1, "batch_num_tokens": experience.action_mask.sum().float(),
                               "global_batch_size": torch.tensor(float(experience.action_mask.shape[0]))}
        action_log_probs, output = self.actor(experience.sequences, experience.action_mask,
                                              attention_mask=experience.attention_mask, return_output=True,
                                              ring_attn_group=None, packed_seq_lens=None,
                                              return_entropy=self.args.actor.entropy_coef is not None)
        actor_loss, clip_ratio, ppo_kl, _ = self.actor_loss_fn(action_log_probs, experience.action_log_probs,
                                                               experience.advantages, action_mask=experience.action_mask,
                                                               rollout_log_probs=experience.rollout_log_probs,
                                                               **loss_batch_info)
        experience.info["ppo_clip_ratio"] = clip_ratio.detach()
        loss = actor_loss
        if self.args.algo.kl.use_loss:
            kl = k3(action_log_probs, experience.base_action_log_probs)
            loss = loss + aggregate_loss(kl, experience.action_mask, **loss_batch_info) * kl_ctl
        if self.args.actor.entropy_coef is not None:
            ent = aggregate_loss(output.entropy[:, -experience.action_mask.shape[1]:], experience.action_mask,
                                 **loss_batch_info)
            loss = loss - ent * self.args.actor.entropy_coef
        self.losses.append(float(loss.detach()))
        self.strategy.backward(loss, self.actor, self.actor_optim)
        self.strategy.optimizer_step(self.actor_optim, self.actor, None, name="actor")
        return {"metrics": {"policy_loss": actor_loss.detach()}, "num_action_tokens": float(experience.action_mask.sum())}


def step_norms(experiences: list[Experience], gas: int) -> dict:
    """loss_batch_info for one optimizer step's window (OpenRLHF: _optimizer_step_loss_norm, one rank)."""
    tokens = sum(e.action_mask.float().sum() for e in experiences)
    samples = sum(float((e.action_mask.sum(-1) > 0).sum()) for e in experiences)
    return {"dp_size": 1, "batch_num_tokens": tokens / gas, "global_batch_size": torch.tensor(samples / gas)}


def fill_logprobs(actor: Actor, exp: Experience, *, noise: float = 0.0, g: torch.Generator | None = None) -> None:
    """action_log_probs = the current policy's (on-policy, as make_experience scores them); rollout =
    those + engine noise; base (reference) = those."""
    with torch.no_grad():
        lp = actor(exp.sequences, exp.action_mask, attention_mask=exp.attention_mask)
    exp.action_log_probs = lp.clone()
    exp.base_action_log_probs = lp.clone()
    jitter = noise * torch.randn(lp.shape, generator=g) if noise else torch.zeros_like(lp)
    exp.rollout_log_probs = (lp + jitter) * exp.action_mask.float()


def make_trainer(seed: int = 0, gas: int = 2, lr: float = 0.05, zero_stage: int | None = None, **kw) -> Trainer:
    module = HFShaped(seed)
    engine = Engine(module, torch.optim.SGD(module.parameters(), lr=lr), gas, zero_stage=zero_stage)
    return Trainer(Actor(engine, packing_samples=kw.get("packing", False)), gas, **kw)


def random_rows(g: torch.Generator, n: int = 4) -> list[tuple[list[int], list[int]]]:
    rows = []
    for _ in range(n):
        p, r = int(torch.randint(3, 7, (1,), generator=g)), int(torch.randint(4, 10, (1,), generator=g))
        rows.append((torch.randint(VOCAB, (p,), generator=g).tolist(), torch.randint(VOCAB, (r,), generator=g).tolist()))
    return rows
