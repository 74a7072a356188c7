"""OpenRLHF 0.11.2's PPO actor update on a real DeepSpeed ZeRO engine (CPU accelerator, gloo), watched by
``GradlocOpenRLHF``. Used by test_openrlhf_zero.py (every rank of a ``tests/distributed/launch.run`` job).

What is OpenRLHF's own (``pip install --no-deps openrlhf==0.11.2``, scripts/setup.sh): ``Experience``,
``Actor`` (around a tiny random ``LlamaForCausalLM`` built from a config), ``PolicyLoss`` (PPO clip with
the token-level TIS correction: ``is_correction_level="token"``, ``mode="clip"``, threshold (0, 1e4)),
``aggregate_loss``, ``DeepspeedStrategy`` (its ``backward``/``optimizer_step``/``get_grad_norm``) and the
loss normalizers of ``utils.loss_utils.iter_grad_accum_global_norm`` (all-reduced over the ranks). The
engine is ``deepspeed.initialize`` with OpenRLHF's ``get_train_ds_config`` (ZeRO stage as asked, fp32),
set as ``actor.model`` as ``DeepspeedStrategy._ds_init_train_model`` does. What is not: the trainer.
``ActorPPOTrainer`` imports ray and vllm at module load, so :class:`PPOTrainer` carries its
``training_step`` copied from 0.11.2 (text only, no dynamic batch, no aux loss, no EMA).
``openrlhf.models`` imports flash_attn at module load: a stub module stands in (never called here).

``plant`` = (rank, step): there, action ``PLANT_ACTION`` of row ``PLANT_ROW`` of micro-batch 1 gets a rollout
log-prob 8 nats below the trainer's: an IS weight of e^8.
"""
from __future__ import annotations

import importlib.machinery
import sys
import types
from types import SimpleNamespace
from typing import Any

VOCAB, B, GAS = 96, 4, 2
PLANT_ROW, PLANT_ACTION = 2, 2  # the 3rd action of row 2 of micro-batch 1


def stub_flash_attn() -> None:
    """``openrlhf.models`` imports flash_attn (bert_padding, utils.distributed) at module load; flash-attn
    needs CUDA to build. The names exist here and are never called (no packing, no ring attention)."""
    def module(name: str, **attrs: Any) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec() callers see a module, not a crash
        m.__dict__.update(attrs)
        return m

    def absent(*_: Any, **__: Any) -> Any:
        raise RuntimeError("flash_attn is a stub in this test")

    sys.modules.setdefault("flash_attn", module("flash_attn"))
    sys.modules.setdefault("flash_attn.bert_padding", module(
        "flash_attn.bert_padding", index_first_axis=absent, pad_input=absent, rearrange=absent, unpad_input=absent))
    sys.modules.setdefault("flash_attn.utils", module("flash_attn.utils"))
    sys.modules.setdefault("flash_attn.utils.distributed", module("flash_attn.utils.distributed", all_gather=absent))


class PPOTrainer:
    """The state ``ActorPPOTrainer.training_step`` reads, and that method as OpenRLHF 0.11.2 writes it."""

    def __init__(self, strategy: Any, actor: Any, optim: Any, scheduler: Any) -> None:
        from openrlhf.models import PolicyLoss

        self.strategy, self.args, self.actor = strategy, strategy.args, actor
        self.actor_optim, self.actor_scheduler, self.ema_model = optim, scheduler, None
        self.actor_loss_fn = PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.2, is_correction_level="token",
                                        is_correction_mode="clip", is_correction_threshold=(0.0, 1e4))
        self.aux_loss = False

    def training_step(self, experience: Any, kl_ctl: float, step: int, loss_batch_info: Any = None) -> dict:
        from openrlhf.models import aggregate_loss

        self.actor.train()
        action_log_probs, output = self.actor(experience.sequences, experience.action_mask,
                                              attention_mask=experience.attention_mask, return_output=True,
                                              ring_attn_group=self.strategy.ring_attn_group, packed_seq_lens=None,
                                              return_entropy=self.args.actor.entropy_coef is not None)
        actor_loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio = self.actor_loss_fn(
            action_log_probs, experience.action_log_probs, experience.advantages, action_mask=experience.action_mask,
            rollout_log_probs=experience.rollout_log_probs, **loss_batch_info)
        experience.info["ppo_clip_ratio"] = clip_ratio.detach()
        experience.info["ppo_kl"] = ppo_kl.detach()
        loss = actor_loss  # args.algo.kl.use_loss is off
        if self.args.actor.entropy_coef is not None:
            entropy_loss = aggregate_loss(output.entropy[:, -experience.action_mask.shape[1]:], experience.action_mask,
                                          **loss_batch_info)
            if self.args.actor.entropy_coef != 0:
                loss -= entropy_loss * self.args.actor.entropy_coef
        self.strategy.backward(loss, self.actor, self.actor_optim)
        self.strategy.optimizer_step(self.actor_optim, self.actor, self.actor_scheduler, name="actor")
        return {"metrics": {"policy_loss": actor_loss.detach(), "actor_grad_norm": self.strategy.get_grad_norm(self.actor)},
                "num_action_tokens": float(experience.action_mask.sum().item())}


def build(stage: int, lr: float = 1e-3) -> PPOTrainer:
    import deepspeed
    import torch
    from openrlhf.models import Actor
    from openrlhf.utils.deepspeed import DeepspeedStrategy
    from openrlhf.utils.deepspeed.deepspeed_utils import get_train_ds_config
    from transformers import LlamaConfig, LlamaForCausalLM

    world = torch.distributed.get_world_size()
    args = SimpleNamespace(ds=SimpleNamespace(param_dtype="fp32", packing_samples=False),
                           # entropy_coef 0: the actor computes its token entropies (logged, not in the loss)
                           train=SimpleNamespace(dynamic_batch_enable=False), actor=SimpleNamespace(entropy_coef=0.0),
                           algo=SimpleNamespace(kl=SimpleNamespace(use_loss=False, init_coef=0.0)))
    strategy = DeepspeedStrategy(seed=0, max_norm=1.0, micro_train_batch_size=B, train_batch_size=B * GAS * world,
                                 zero_stage=stage, args=args)
    strategy.accumulated_gradient = GAS  # setup_distributed computes it (and needs CUDA)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         attn_implementation="eager"))
    actor = Actor(model)
    actor.packing_samples = False  # set by Actor.__init__ only when it loads the model from a path
    ds_config = get_train_ds_config(offload=False, adam_offload=False, stage=stage, param_dtype="fp32", max_norm=1.0,
                                    zpg=1)
    zero = ds_config["zero_optimization"]
    # "auto" values are filled by HF's integration, not by deepspeed.initialize: dropped (DeepSpeed's defaults).
    # OpenRLHF's offload_* {"device": "none"} entries stay: that is no offload, and gradloc reads it so.
    ds_config["zero_optimization"] = {k: v for k, v in zero.items() if v != "auto"}
    if stage == 3:
        ds_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition every parameter
    ds_config.update(train_micro_batch_size_per_gpu=B, gradient_accumulation_steps=GAS, steps_per_print=10**9)
    optim = torch.optim.AdamW(model.parameters(), lr=lr)  # a client optimizer ZeRO accepts as tested
    engine, optim, _, _ = deepspeed.initialize(model=model, optimizer=optim, config=ds_config)
    actor.model = engine  # as DeepspeedStrategy._ds_init_train_model does for the actor
    return PPOTrainer(strategy, actor, optim, None)  # a constant learning rate: no scheduler


def experience(g: Any, actor: Any) -> Any:
    """B random (prompt, response) rows as OpenRLHF batches them: right-padded, action j ↔ token j + 1,
    old = reference = the current policy's log-probs (on-policy), rollout = old + engine noise."""
    import torch
    from openrlhf.trainer.ppo_utils.experience import Experience

    rows = []
    for _ in range(B):
        p, r = int(torch.randint(3, 7, (1,), generator=g)), int(torch.randint(4, 10, (1,), generator=g))
        rows.append((torch.randint(VOCAB, (p,), generator=g).tolist(), torch.randint(VOCAB, (r,), generator=g).tolist()))
    T = max(len(p) + len(r) for p, r in rows)
    seq, att, act = (torch.zeros(B, T, dtype=torch.long) for _ in range(3))
    for i, (p, r) in enumerate(rows):
        seq[i, :len(p) + len(r)], att[i, :len(p) + len(r)], act[i, len(p):len(p) + len(r)] = torch.tensor(p + r), 1, 1
    action_mask = act[:, 1:].bool()
    with torch.no_grad():
        old = actor(seq, action_mask, attention_mask=att)
    adv = torch.randn(B, 1, generator=g) * action_mask.float()
    rollout = (old + 0.01 * torch.randn(old.shape, generator=g)) * action_mask.float()
    return Experience(sequences=seq, attention_mask=att, action_mask=action_mask, action_log_probs=old.clone(),
                      base_action_log_probs=old.clone(), rollout_log_probs=rollout, advantages=adv,
                      response_length=torch.tensor([len(r) for _, r in rows]), truncated=torch.zeros(B, dtype=torch.bool))


def train(rank: int, world: int, stage: int, steps: int, plant: tuple[int, int] | None, watched: bool,
          **watch: Any) -> dict:
    """``steps`` PPO optimizer steps of GAS micro-batches on this rank; what the tests check, by value."""
    stub_flash_attn()
    import torch
    from openrlhf.utils.loss_utils import iter_grad_accum_global_norm

    import gradloc
    from gradloc.integrations.openrlhf import GradlocOpenRLHF
    from tests.distributed.ds_common import engine_params

    trainer = build(stage)
    engine = trainer.actor.model
    hooks = GradlocOpenRLHF(trainer, detector=gradloc.DetectorConfig(warmup=5), update_ratio="off", store=False,
                            **watch) if watched else None
    g = torch.Generator().manual_seed(7 + rank)
    ds_norms, planted, ent = [], None, [[0.0, 0.0] for _ in range(steps)]
    at = [0]

    def read(_m: Any, args: Any, _kw: Any, out: Any) -> None:  # the actor output's Σ entropy over the actions
        if isinstance(out, tuple) and getattr(out[1], "entropy", None) is not None:
            mask = args[1].float()
            ent[at[0]][0] += float((out[1].entropy.detach()[:, -mask.shape[1]:] * mask).sum())
            ent[at[0]][1] += float(mask.sum())

    handle = trainer.actor.register_forward_hook(read, with_kwargs=True)
    for s in range(steps):
        at[0] = s
        exps = [experience(g, trainer.actor) for _ in range(GAS)]
        if plant == (rank, s):
            j = int(exps[1].action_mask[PLANT_ROW].nonzero()[PLANT_ACTION])
            exps[1].rollout_log_probs[PLANT_ROW, j] -= 8.0
            planted = (1, PLANT_ROW, j)
        for k, (e, info) in enumerate(iter_grad_accum_global_norm(exps, trainer.strategy, GAS, lambda e: e.action_mask)):
            status = trainer.training_step(e, 0.0, s * GAS + k, info)
        ds_norms.append(status["metrics"]["actor_grad_norm"])  # DeepSpeed's pre-clip norm (get_global_grad_norm)
    handle.remove()
    out = {"ds_norms": ds_norms, "params": engine_params(engine, stage), "planted": planted, "entropy_sums": ent}
    if hooks is not None:
        out.update(kind=hooks.mon.job.kind, probes=hooks.probes, errors=hooks.blocks.errors,
                   counters=dict(hooks.mon.counters),
                   reports=[(r.record.global_norm, r.spike.kinds, r.incident.scope if r.incident else None,
                             r.incident.localization if r.incident else None) for r in hooks.reports],
                   entropy=[(r.record.rl.entropy_mean, r.record.rl.job_entropy_mean) for r in hooks.reports])
        hooks.detach()
    return out
