"""verl 0.9.1's own FSDP2 engine on gloo CPU processes, driven the way verl's actor update drives it.

Each rank (launched by tests/distributed/launch.py) registers and selects the CPU platform (verl_cpu.py),
installs gradloc with ``gradloc.integrations.verl.install(FSDPEngineWithLMHead)`` — what a user's
``external_lib`` does — and builds ``FSDPEngineWithLMHead`` from verl's own configs
(``HFModelConfig``, ``FSDPEngineConfig(strategy="fsdp2")``, ``FSDPOptimizerConfig``) on a tiny random
Qwen2 saved with ``save_pretrained``: the engine shards it with ``fully_shard`` over the ranks.

Per step, like ``RayPPOTrainer`` + ``TrainingWorker``: each rank draws its own prompts (``N_PROMPTS`` × ``N``
samples), computes old log-probs with ``engine.infer_batch`` (verl's compute_log_prob), rewards → GRPO
advantages (``core_algos.compute_grpo_outcome_advantage``), rollout log-probs = old + engine noise, IS
weights from verl's ``compute_rollout_correction_weights`` (token TIS, threshold 1e4), a ``DataProto``
→ ``to_tensordict`` → ``left_right_2_no_padding``, then ``engine.train_batch`` with verl's ``ppo_loss``
(``core_algos`` vanilla policy loss × ``rollout_is_weights``, ``agg_loss`` token-mean).

``plant`` = (rank, step): on that rank and step, sample ``PLANT_SAMPLE``'s response token ``PLANT_TOKEN``
gets a rollout log-prob 8 nats below the trainer's (an IS weight of e^8).
"""
from __future__ import annotations

from functools import partial
from typing import Any

VOCAB, N_PROMPTS, N, MICRO = 96, 4, 2, 4  # 8 sequences per rank and step, micro-batches of 4
PLANT_SAMPLE, PLANT_TOKEN = 5, 2  # micro-batch 1, its sample 1, response token 2
WATCH = dict(update_ratio="off", store=False)


def save_model(path: str) -> str:
    """A tiny random Qwen2 (2 layers, hidden 32, untied head) written as a Hugging Face checkpoint."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def build_engine(model_dir: str, lr: float) -> Any:
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    # eager attention and no remove-padding: flash-attention's varlen kernels do not exist on CPU
    model = HFModelConfig(path=model_dir, load_tokenizer=False, override_config={"attn_implementation": "eager"},
                          use_remove_padding=False, enable_gradient_checkpointing=False)
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    engine = FSDPEngineWithLMHead(model, FSDPEngineConfig(strategy="fsdp2", mixed_precision=fp32,
                                                          use_torch_compile=False),
                                  FSDPOptimizerConfig(lr=lr, clip_grad=1.0, total_training_steps=100),
                                  CheckpointConfig())
    engine.initialize()
    return engine


def actor_config(**kw: Any) -> Any:
    from verl.workers.config import FSDPActorConfig

    return FSDPActorConfig(strategy="fsdp2", rollout_n=N, ppo_mini_batch_size=N_PROMPTS,
                           ppo_micro_batch_size_per_gpu=MICRO, use_torch_compile=False, clip_ratio=0.2, **kw)


def _rows(g: Any) -> list[tuple[list[int], list[int], str]]:
    import torch

    rows = []
    for q in range(N_PROMPTS):
        prompt = torch.randint(VOCAB, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        for _ in range(N):
            r = int(torch.randint(4, 10, (1,), generator=g))
            rows.append((prompt, torch.randint(VOCAB, (r,), generator=g).tolist(), f"p{q}"))
    return rows


def _no_padding(batch: Any, world: int, entropy: bool = False, micro: int = MICRO) -> Any:
    """DataProto → the TensorDict the actor's engine receives (RayPPOTrainer._update_actor + TrainingWorker)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=entropy, global_batch_size=N_PROMPTS * N * world,
                         use_remove_padding=False, use_dynamic_bsz=False, micro_batch_size_per_gpu=micro,
                         use_fused_kernels=False, max_token_len_per_gpu=16384)
    return td


def make_batch(g: Any, engine: Any, world: int, plant: bool, ref: bool = False) -> Any:
    """One rank's step batch: (DataProto with old/rollout log-probs, advantages, IS weights; its TensorDict)."""
    import numpy as np
    import torch
    from verl import DataProto
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
    from verl.workers.utils.padding import no_padding_2_padding

    rows = _rows(g)
    B, P, R = len(rows), max(len(p) for p, _, _ in rows), max(len(r) for _, r, _ in rows)
    prompts, responses = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, R, dtype=torch.long)
    attention = torch.zeros(B, P + R, dtype=torch.long)
    for i, (p, r, _) in enumerate(rows):
        prompts[i, P - len(p):], responses[i, :len(r)] = torch.tensor(p), torch.tensor(r)  # left / right padded
        attention[i, P - len(p):P + len(r)] = 1
    response_mask = attention[:, P:].float()
    uid = np.array([u for _, _, u in rows], dtype=object)
    tensors = dict(prompts=prompts, responses=responses, input_ids=torch.cat([prompts, responses], 1),
                   attention_mask=attention, position_ids=(attention.cumsum(1) - 1).clamp(min=0),
                   response_mask=response_mask)
    probe = DataProto.from_dict(tensors=dict(tensors), non_tensors={"uid": uid}, meta_info={"temperature": 1.0})
    out = engine.infer_batch(_no_padding(probe, world))  # verl's compute_log_prob: the current policy's log-probs
    old = no_padding_2_padding(out["model_output"]["log_probs"], probe.to_tensordict()) * response_mask  # (B, R)
    reward = torch.zeros(B, R)
    score = torch.randint(0, 2, (B,), generator=g).float()  # one outcome reward per sequence, at its last token
    if plant:
        score[PLANT_SAMPLE - PLANT_SAMPLE % N: PLANT_SAMPLE - PLANT_SAMPLE % N + N] = torch.arange(N) % 2
        # its group's answers differ, so its GRPO advantage is not 0
    reward[torch.arange(B), response_mask.sum(1).long() - 1] = score
    advantages, _ = core_algos.compute_grpo_outcome_advantage(reward, response_mask, uid)
    rollout = old + 0.01 * torch.randn(B, R, generator=g) * response_mask
    if plant:
        rollout[PLANT_SAMPLE, PLANT_TOKEN] -= 8.0  # the inference engine's log-prob, 8 nats off: IS weight e^8
    weights, _ = compute_rollout_correction_weights(old - rollout, response_mask, rollout_is="token",
                                                    rollout_is_threshold=1e4)
    tensors.update(old_log_probs=old, advantages=advantages, rollout_log_probs=rollout, rollout_is_weights=weights)
    if ref:  # a reference policy apart from the current one, for the KL loss
        tensors["ref_log_prob"] = old + 0.3 * torch.randn(B, R, generator=g) * response_mask
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid}, meta_info={"temperature": 1.0})


def train(rank: int, world: int, model_dir: str, steps: int, plant: tuple[int, int] | None, watched: bool,
          lr: float = 1e-2, entropy: bool = False, **watch: Any) -> dict:
    """``steps`` PPO updates (one mini-batch each) on this rank; what the tests check, by value. ``entropy``: the
    engine computes the token entropies (``calculate_entropy``; the loss's coefficient stays 0), and the result
    has per step this rank's Σ entropy over its response tokens and their count, read from the model output the
    loss gets (``entropy_sums``)."""
    import torch

    from tests.verl_tier.inside.verl_cpu import install_cpu_platform

    install_cpu_platform()
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.utils.losses import ppo_loss

    import gradloc
    from gradloc.integrations.verl import install

    uninstall = install(FSDPEngineWithLMHead, **{**WATCH, "detector": gradloc.DetectorConfig(warmup=5), **watch}) \
        if watched else (lambda: None)
    try:
        engine = build_engine(model_dir, lr)
    finally:
        uninstall()
    hooks = getattr(engine, "gradloc", None)
    ppo = partial(ppo_loss, config=actor_config())
    sums: list[list[float]] = []

    def loss_fn(model_output: Any, data: Any, dp_group: Any = None) -> Any:
        from verl.workers.utils.padding import no_padding_2_padding

        if model_output.get("entropy") is not None:  # (a spike step's probes call it again: added there too)
            e = no_padding_2_padding(model_output["entropy"], data).detach()  # (B, R)
            m = data["response_mask"].to(bool)  # (B, R)
            sums[-1][0] += float(e[m].double().sum())
            sums[-1][1] += int(m.sum())
        return ppo(model_output=model_output, data=data, dp_group=dp_group)

    g = torch.Generator().manual_seed(100 + rank)
    grad_norms = []
    with engine.train_mode():
        for step in range(steps):
            batch = make_batch(g, engine, world, plant is not None and plant == (rank, step))
            sums.append([0.0, 0])
            out = engine.train_batch(_no_padding(batch, world, entropy=entropy), loss_function=loss_fn)
            grad_norms.append(float(out["metrics"]["grad_norm"]))
    params = {n: p.full_tensor().detach().clone() for n, p in engine.module.named_parameters()}
    result = {"grad_norms": grad_norms, "params": params, "watched": hooks is not None, "entropy_sums": sums}
    if hooks is not None:
        result.update(kind=hooks.mon.job.kind, probes=hooks.probes, errors=hooks.blocks.errors,
                      counters=dict(hooks.mon.counters),
                      entropy=[(r.record.rl.entropy_mean, r.record.rl.job_entropy_mean) if r.record.rl else None
                               for r in hooks.reports],
                      reports=[(r.record.global_norm, r.spike.kinds, r.incident.scope if r.incident else None,
                                r.incident.localization if r.incident else None) for r in hooks.reports])
        hooks.detach()
    return result


def probe_exactness(rank: int, world: int, model_dir: str) -> dict:
    """verl's own ppo_loss (vanilla policy loss × IS weights, entropy bonus, low_var_kl KL loss, token-mean
    agg_loss) restricted by ``masked_loss_function`` inside the real engine's forward_step, one micro-batch:
    (loss, gradient) with the full response mask, with a random subset S, with its complement, and the
    training loss's own — for the test to compare."""
    import torch

    from tests.verl_tier.inside.verl_cpu import install_cpu_platform

    install_cpu_platform()
    from verl.workers.utils.losses import ppo_loss

    from gradloc.integrations.verl import layout, masked_loss_function

    engine = build_engine(model_dir, 1e-2)
    loss_fn = partial(ppo_loss, config=actor_config(entropy_coeff=0.05, use_kl_loss=True, kl_loss_coef=0.3,
                                                    calculate_entropy=True))
    g = torch.Generator().manual_seed(3)
    batch = make_batch(g, engine, world, plant=False, ref=True)
    pick = torch.Generator().manual_seed(4)

    def run(restrict: Any) -> tuple[float, list]:
        def loss(model_output: Any, data: Any, dp_group: Any = None) -> Any:
            if restrict is None:
                return loss_fn(model_output=model_output, data=data, dp_group=dp_group)
            lay = layout(data)  # the micro-batch as the engine hands it to the loss
            fn = masked_loss_function(loss_fn, lay, restrict(lay))
            return fn(model_output=model_output, data=data, dp_group=dp_group)

        engine.optimizer_zero_grad()
        td = _no_padding(batch, world, entropy=True, micro=N_PROMPTS * N)  # one micro-batch: the whole batch
        out = engine.forward_backward_batch(td, loss, forward_only=False)
        grads = [p.grad.full_tensor().clone() for p in engine.module.parameters()]
        return float(sum(out["loss"])), grads

    subset: dict[str, Any] = {}

    def part(lay: Any, complement: bool) -> Any:
        if "s" not in subset:
            subset["s"] = torch.rand(lay.loss_mask.shape, generator=pick) < 0.3
        s = lay.loss_mask & subset["s"]
        return lay.loss_mask & ~s if complement else s

    with engine.train_mode():
        train = run(None)
        full = run(lambda lay: lay.loss_mask)
        some = run(lambda lay: part(lay, False))
        rest = run(lambda lay: part(lay, True))
    return {"train": train, "full": full, "some": some, "rest": rest}

