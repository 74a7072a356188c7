"""A verl 0.9-shaped stand-in for the adapter tests: verl itself cannot run here (its FSDP engine is
registered for CUDA/NPU only and its workers need Ray), and tensordict is not installed.

What is imitated, read from verl v0.9.0 (``verl/workers/engine/fsdp/transformer_impl.py``,
``verl/workers/utils/losses.py``, ``verl/workers/utils/padding.py``, ``verl/trainer/ppo/core_algos.py``):

- :class:`Batch`: a ``dict`` with the ``TensorDict`` methods the engine uses (``.to``, ``.copy``,
  ``.get``), holding what ``left_right_2_no_padding`` makes of the trainer's batch: nested jagged
  ``input_ids``/``position_ids`` (prompt + response, no padding), padded ``prompts`` (left) and
  ``responses`` (right), ``attention_mask`` over both, response-level (B, R) ``response_mask``
  (= ``loss_mask``), ``old_log_probs``, ``advantages``, ``rollout_log_probs``, ``rollout_is_weights``,
  ``ref_log_prob``, ``uid``; scalars (``dp_size``, ``batch_num_tokens``, ``use_remove_padding``) as
  plain values where verl stores ``NonTensorData``.
- :class:`Engine`: the method names and signatures of ``FSDPEngine`` / ``FSDPEngineWithLMHead``:
  ``train_batch`` → ``optimizer_zero_grad``, ``forward_backward_batch`` (global ``batch_num_tokens``,
  micro-batches, ``forward_step`` each, then ``loss.backward()``), ``optimizer_step`` (clip, skip a
  non-finite step, return the pre-clip norm). ``forward_step`` packs the nested ids into one (1, N)
  row (plus ``pad_to_length``'s static pad when asked), runs the model with ``cu_seqlens`` and builds
  ``model_output["log_probs"]`` (and ``entropy``) as nested tensors over the sequences, log-probs of
  the rolled ids; with ``use_remove_padding=False`` the model sees (B, L) right-padded rows instead.
- :func:`ppo_loss`: verl's ``ppo_loss`` with the vanilla (dual-clip) policy loss, written here from
  its formulas: per-token terms × ``rollout_is_weights``, ``agg_loss`` token-mean
  (Σ l·m / batch_num_tokens · dp_size), minus entropy_coeff × entropy, plus the low_var_kl KL loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import torch
from torch import nn

from gradloc.demo.model import GPTConfig, TinyGPT

VOCAB = 96


class Batch(dict):
    """The TensorDict surface verl's engine and losses use (see the module docstring)."""

    def to(self, device):
        return Batch({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.items()})

    def copy(self):
        return Batch(self)


class HFShaped(nn.Module):
    """TinyGPT behind the keyword call verl makes: ``module(input_ids=, attention_mask=None,
    position_ids=, use_cache=False, cu_seqlens=)`` → an output with ``.logits``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.gpt = TinyGPT(GPTConfig(vocab=VOCAB, seq=32, d_model=32, n_layers=2, n_heads=4))

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, cu_seqlens=None, **_):
        return SimpleNamespace(logits=self.gpt(input_ids, cu_seqlens=cu_seqlens))


@dataclass
class Sample:
    prompt: list[int]
    response: list[int]
    uid: str
    old: list[float] | None = None
    rollout: list[float] | None = None
    advantage: float = 1.0
    response_mask: list[int] | None = None


def nested(rows):
    return torch.nested.as_nested_tensor([torch.as_tensor(r) for r in rows], layout=torch.jagged)


def make_batch(samples: list[Sample], *, nested_responses: bool = False, ref: list[list[float]] | None = None) -> Batch:
    """One verl micro-batch (or mini-batch) in the no-padding layout the actor update receives."""
    B = len(samples)
    P, R = max(len(s.prompt) for s in samples), max(len(s.response) for s in samples)
    prompts = torch.zeros(B, P, dtype=torch.long)
    responses = torch.zeros(B, R, dtype=torch.long)
    attention = torch.zeros(B, P + R, dtype=torch.long)
    fields = {k: torch.zeros(B, R) for k in ("response_mask", "old_log_probs", "advantages", "rollout_log_probs",
                                             "rollout_is_weights", "ref_log_prob")}
    for i, s in enumerate(samples):
        p, r = len(s.prompt), len(s.response)
        prompts[i, P - p:] = torch.tensor(s.prompt)  # left-padded
        responses[i, :r] = torch.tensor(s.response)  # right-padded
        attention[i, P - p:P + r] = 1
        fields["response_mask"][i, :r] = torch.tensor(s.response_mask or [1] * r, dtype=torch.float32)
        old = torch.tensor(s.old if s.old is not None else [-1.0] * r)
        rollout = torch.tensor(s.rollout if s.rollout is not None else old.tolist())
        fields["old_log_probs"][i, :r], fields["rollout_log_probs"][i, :r] = old, rollout
        fields["rollout_is_weights"][i, :r] = torch.exp(old - rollout)  # untruncated IS weights π_old / π_rollout
        fields["advantages"][i, :r] = s.advantage
        fields["ref_log_prob"][i, :r] = torch.tensor(ref[i]) if ref is not None else old
    b = Batch(input_ids=nested([s.prompt + s.response for s in samples]),
              position_ids=nested([list(range(len(s.prompt) + len(s.response))) for s in samples]),
              prompts=prompts, responses=responses, attention_mask=attention, uid=[s.uid for s in samples],
              use_remove_padding=True, dp_size=1, **fields)
    b["loss_mask"] = b["response_mask"]
    if nested_responses:  # the trainer-v1 layout: response-level fields as nested (B, j_resp)
        lens = [len(s.response) for s in samples]
        b["responses"] = nested([s.response for s in samples])
        for k in ("response_mask", "old_log_probs", "advantages", "rollout_log_probs", "rollout_is_weights",
                  "ref_log_prob"):
            b[k] = nested([b[k][i, :n] for i, n in enumerate(lens)])
        b["loss_mask"] = b["response_mask"]
        del b["prompts"], b["attention_mask"]
    return b


# -- the loss ---------------------------------------------------------------------------------------
def actor_config(**kw):
    cfg = dict(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0, entropy_coeff=0.0,
               use_kl_loss=False, kl_loss_coef=0.001)
    cfg.update(kw)
    return SimpleNamespace(**cfg)


def response_slice(values: torch.Tensor, data) -> torch.Tensor:
    """(B, R) log-probs of the response tokens from nested per-sequence values (verl: no_padding_2_padding)."""
    flat, off = values.values(), values.offsets()
    if data.get("prompts") is not None:
        P = data["prompts"].shape[1]
        resp = data["attention_mask"][:, P:].sum(1)
        R = data["responses"].shape[1]
    else:
        resp = data["responses"].offsets().diff()
        R = int(resp.max())
    rows = []
    for i in range(len(resp)):
        r, end = int(resp[i]), int(off[i + 1])
        rows.append(torch.nn.functional.pad(flat[end - r - 1:end - 1], (0, R - r)))  # left-shifted by one
    return torch.stack(rows)


def padded(t):
    return t.to_padded_tensor(0.0) if t.is_nested else t


def token_terms(config, log_prob, entropy, data):
    """Per-token loss terms of verl's ppo_loss (before aggregation), each (B, R)."""
    old, adv = padded(data["old_log_probs"]), padded(data["advantages"])
    w = data.get("rollout_is_weights")
    lo = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    hi = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    ratio = torch.exp(torch.clamp(log_prob - old, -20.0, 20.0))
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - lo, 1 + hi)
    c1 = torch.maximum(l1, l2)
    pg = torch.where(adv < 0, torch.minimum(-adv * config.clip_ratio_c, c1), c1)
    if w is not None:
        pg = pg * padded(w)
    terms = pg
    if entropy is not None:
        terms = terms - config.entropy_coeff * entropy
    if config.use_kl_loss:
        kl = padded(data["ref_log_prob"]) - log_prob
        terms = terms + config.kl_loss_coef * torch.clamp(torch.exp(kl) - kl - 1, -10, 10)
    return terms


def ppo_loss(config, model_output, data, dp_group=None):
    log_prob = response_slice(model_output["log_probs"], data)
    ent = model_output.get("entropy")
    entropy = response_slice(ent, data) if ent is not None else None
    mask = padded(data["response_mask"]).bool()
    terms = token_terms(config, log_prob, entropy, data)
    loss = (terms * mask).sum() / data["batch_num_tokens"] * data["dp_size"]  # agg_loss token-mean
    return loss, {"actor/pg_loss": float(loss.detach())}


# -- the engine -------------------------------------------------------------------------------------
class Engine:
    """FSDPEngine / FSDPEngineWithLMHead method names and signatures (see the module docstring)."""

    def __init__(self, module: nn.Module, optimizer=None, clip_grad: float = 1.0, micro_batch_size: int = 4,
                 pad_to_length_bucket: int | None = None):
        self.module, self.optimizer = module, optimizer
        self.optimizer_config = SimpleNamespace(clip_grad=clip_grad)
        self.scaler = None
        self.micro_batch_size = micro_batch_size
        self.pad_to_length, self.pad_to_length_bucket = pad_to_length_bucket is not None, pad_to_length_bucket
        self.grad_norms: list[float] = []

    def initialize(self):
        return None

    def _get_packed_pad_size(self, packed_length: int) -> int:
        if not self.pad_to_length:  # verl's default
            return 0
        bucket = self.pad_to_length_bucket
        return -(-packed_length // bucket) * bucket - packed_length

    def train_batch(self, data: Batch, loss_function):
        self.optimizer_zero_grad()
        outputs = self.forward_backward_batch(data, loss_function, forward_only=False)
        self.grad_norms.append(self.optimizer_step())
        return outputs

    def infer_batch(self, data: Batch, loss_function=None):
        with torch.no_grad():
            return self.forward_backward_batch(data, loss_function, forward_only=True)

    def forward_backward_batch(self, data: Batch, loss_function, forward_only=False):
        data["batch_num_tokens"] = float(padded(data["loss_mask"]).sum())  # (all-reduced over dp in verl)
        outputs = []
        for mb in chunk(data, self.micro_batch_size):
            loss, meta = self.forward_step(mb, loss_function=loss_function, forward_only=forward_only)
            if not forward_only:
                loss.backward()
            outputs.append(meta)
        return outputs

    def forward_step(self, micro_batch, loss_function, forward_only):
        raise NotImplementedError("forward_step must be implemented in subclass")

    def optimizer_zero_grad(self):
        self.optimizer.zero_grad()

    def optimizer_step(self):
        grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm=self.optimizer_config.clip_grad)
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad()
        else:
            self.optimizer.step()
        return grad_norm.item()


class EngineWithLMHead(Engine):
    def forward_step(self, micro_batch, loss_function, forward_only):
        micro_batch = micro_batch.to("cpu")
        input_ids = micro_batch["input_ids"]
        cu = input_ids.offsets()
        rolled = torch.roll(input_ids.values(), shifts=-1)  # (N,): position q scores id q + 1
        if micro_batch.get("use_remove_padding", True):
            ids = input_ids.values().unsqueeze(0)  # (N,) -> (1, N)
            n, pad = ids.shape[1], self._get_packed_pad_size(ids.shape[1])
            model_cu = cu
            if pad:  # pad_to_length: the model sees N + pad tokens, the pad as one more sequence (cu_seqlens)
                ids = torch.cat([ids, ids.new_zeros(1, pad)], 1)
                model_cu = torch.cat([cu, cu.new_tensor([n + pad])])
            out = self.module(input_ids=ids, attention_mask=None, position_ids=None, use_cache=False,
                              cu_seqlens=model_cu)
            logits = out.logits.squeeze(0)[:n]  # (1, N + pad, V) -> (N, V): the pad stripped
        else:  # (B, L) right-padded rows, then each row's valid logits back to back
            lens = cu.diff()
            padded_ids = input_ids.to_padded_tensor(0, output_size=(len(lens), int(lens.max())))
            out = self.module(input_ids=padded_ids, use_cache=False)
            logits = out.logits[torch.arange(padded_ids.shape[1])[None] < lens[:, None]]  # (B, L, V) -> (N, V)
        logp_all = torch.log_softmax(logits.float(), -1)
        model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(
            logp_all.gather(-1, rolled[:, None]).squeeze(-1), cu)}
        if micro_batch.get("calculate_entropy"):
            ent = -(logp_all.exp() * logp_all).sum(-1)
            model_output["entropy"] = torch.nested.nested_tensor_from_jagged(ent, cu)
        if loss_function is not None:
            loss, metrics = loss_function(model_output=model_output, data=micro_batch, dp_group=None)
        else:
            loss, metrics = torch.tensor(1.0), {}
        return loss, {"model_output": {k: v.detach() for k, v in model_output.items()}, "loss": float(loss.detach()),
                      "metrics": metrics}


class EngineWithValueHead(EngineWithLMHead):
    """Like verl's critic engine: a subclass of the actor's class."""


def chunk(data: Batch, size: int) -> list[Batch]:
    """Row chunks of a batch (verl: tu.chunk_tensordict), nested fields re-nested per chunk."""
    B = data["input_ids"].size(0)
    out = []
    for a in range(0, B, size):
        mb = Batch()
        for k, v in data.items():
            if isinstance(v, torch.Tensor) and v.is_nested:
                mb[k] = nested(list(v.unbind())[a:a + size])
            elif isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == B:
                mb[k] = v[a:a + size]
            elif isinstance(v, list):
                mb[k] = v[a:a + size]
            else:
                mb[k] = v
        out.append(mb)
    return out


def loss_fn(**cfg):
    return partial(ppo_loss, config=actor_config(**cfg))


def current_logp(module: nn.Module, samples: list[Sample]) -> list[list[float]]:
    """log π(response token k) per sample, each sequence run alone (no packing) — the reference for
    the packed indexing."""
    out = []
    with torch.no_grad():
        for s in samples:
            seq = torch.tensor(s.prompt + s.response)[None]
            lp = torch.log_softmax(module(input_ids=seq).logits[0].float(), -1)  # (T, V)
            p = len(s.prompt)
            out.append([float(lp[p - 1 + k, t]) for k, t in enumerate(s.response)])
    return out


def random_samples(g: torch.Generator, n_prompts: int = 4, n: int = 2) -> list[Sample]:
    samples = []
    for q in range(n_prompts):
        p = int(torch.randint(3, 7, (1,), generator=g))
        prompt = torch.randint(VOCAB, (p,), generator=g).tolist()
        for _ in range(n):
            r = int(torch.randint(4, 10, (1,), generator=g))
            samples.append(Sample(prompt, torch.randint(VOCAB, (r,), generator=g).tolist(), f"u{q}",
                                  advantage=float(torch.randn((), generator=g))))
    return samples
