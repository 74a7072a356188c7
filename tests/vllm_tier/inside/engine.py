"""A real vLLM engine on a tiny random-weight Llama, for the real-vLLM test tier.

Importable only inside ``.venv-vllm`` (``bash scripts/setup_vllm.sh``): it imports ``vllm``.

Everything is built locally and deterministically (no hub access): a byte-level BPE trained on a
fixed corpus, wrapped as a ``PreTrainedTokenizerFast``, and a seeded random ``LlamaForCausalLM`` saved
with ``save_pretrained`` next to it. The model's weights are scaled up from the usual 0.02 init
(``INIT_STD``) so next-token distributions are peaked rather than uniform over the vocabulary — a
near-uniform model would make every logprob ≈ −log V and hide any trainer/engine mismatch — and the
EOS logit is lifted (``EOS_MARGIN``) so that within 16 tokens some completions stop on EOS and others
hit the length limit, as real rollouts do.

One in-process ``vllm.LLM`` per test session (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), float32, eager.
Two things the CPU engine imposes on whoever shares its process:
- head size must be one of 32, 64, 80, … (vLLM's CPU attention; 16 fails at the first forward), hence
  hidden 128 with 4 query / 2 KV heads;
- starting the engine replaces ``torch.set_num_threads`` with a no-op that logs a warning (its CPU worker
  binds threads once): thread counts must be set through ``OMP_NUM_THREADS`` before the process starts.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

# vLLM reads these at import time or at engine start: set them before importing it. In-process
# engine (no engine-core subprocess), a 1 GiB CPU KV cache, no hub look-ups.
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
os.environ.update(ENGINE_ENV)

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from vllm import LLM, RequestOutput, SamplingParams  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402,F401  (re-exported for the tests)

SEED = 0
MAX_MODEL_LEN = 256
BPE_VOCAB = 384  # byte-level alphabet (256) + specials + ~125 merges
INIT_STD = 0.5
EOS_MARGIN = 9.0  # measured: 13 of 32 completions stop on EOS within 16 tokens, 19 hit the limit
SPECIALS = ("<bos>", "<eos>", "<pad>")

_CORPUS = (
    "the quick brown fox jumps over the lazy dog",
    "a gradient spike is a step whose gradient norm jumps far above its recent history",
    "the policy samples several completions for every prompt and the trainer scores each token",
    "rollouts come from the inference engine and the trainer recomputes their log probabilities",
    "advantages are normalised within each group of completions of the same prompt",
    "tokens with large advantage and low probability dominate the policy gradient",
    "one two three four five six seven eight nine ten eleven twelve",
    "question: what is two plus two? answer: four. question: what is three plus four? answer: seven.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and symbols + - * / = ( ) [ ] { } < > ! ? . , ; :",
)

PROMPTS = (
    "question: what is two plus two? answer:",
    "the policy samples",
    "def add(a, b):",
    "a gradient spike is",
    "one two three",
    "rollouts come from",
    "the quick brown fox",
    "tokens with large advantage",
)


def build_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on the fixed corpus (deterministic) and save it to ``out_dir``."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  model_max_length=MAX_MODEL_LEN)
    tok.save_pretrained(out_dir)
    return tok


def build_model_dir(out_dir: Path, seed: int = SEED) -> Path:
    """Tokenizer + seeded random tiny Llama (float32 safetensors) in ``out_dir``; returns it."""
    out_dir = Path(out_dir)
    tok = build_tokenizer(out_dir)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False, initializer_range=INIT_STD, dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    _lift_eos(model, tok)
    model.save_pretrained(out_dir)
    return out_dir


def _lift_eos(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast) -> None:
    """Replace the EOS row of the (untied) LM head so its logit sits ``EOS_MARGIN`` below the median
    log-partition on the corpus: with ``h̄`` the mean final hidden state, ``w_eos = (lse − margin)·h̄/|h̄|²``
    gives logit ``lse − margin`` at ``h̄`` and more or less elsewhere, so EOS is likely in some contexts
    and rare in others (a random head gives P(EOS) ≈ 0 almost everywhere)."""
    ids = [tok(text)["input_ids"] for text in _CORPUS]
    with torch.no_grad():
        hidden = torch.cat([model.model(torch.tensor([row])).last_hidden_state[0] for row in ids])  # (N, D)
        lse = (hidden @ model.lm_head.weight.T).logsumexp(-1).median()  # (N, V) -> ()
        h_bar = hidden.mean(0)  # (D,)
        model.lm_head.weight[tok.eos_token_id] = (lse - EOS_MARGIN) * h_bar / h_bar.dot(h_bar)


def start_engine(model_dir: Path, seed: int = SEED, dtype: str = "float32") -> LLM:
    """One in-process CPU engine on ``model_dir`` (eager; prefix caching off so every request is computed
    from scratch). ``gpu_memory_utilization`` does not matter here: with ``VLLM_CPU_KVCACHE_SPACE`` set
    the CPU worker skips its check of that fraction of host memory (0.9 of 24 GiB would fail it)."""
    return LLM(model=str(model_dir), tokenizer=str(model_dir), dtype=dtype, enforce_eager=True,
               max_model_len=MAX_MODEL_LEN, seed=seed, enable_prefix_caching=False)


def rollouts(llm: LLM, prompts: Sequence[str], n: int = 4, max_tokens: int = 16, temperature: float = 1.0,
             logprobs: int | None = 0, seed: int = SEED) -> list[RequestOutput]:
    """Sample ``n`` completions per prompt; the real ``RequestOutput`` list, in prompt order.

    ``logprobs=0`` returns, per generated position, a dict holding just the sampled token's logprob;
    ``logprobs=k`` adds the top-k. The engine-level seed plus the per-request ``seed`` (children of an
    ``n > 1`` request get ``seed + index``) make the samples reproducible.
    """
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, logprobs=logprobs, seed=seed)
    return llm.generate(list(prompts), params, use_tqdm=False)


def teacher_forced_logprobs(hf: LlamaForCausalLM, prompt_ids: Sequence[int], completion_ids: Sequence[int],
                            temperature: float = 1.0) -> tuple[list[float], list[int]]:
    """The trainer's side: log π(token) (float64 log-softmax of ``logits / temperature``) and its vocab
    rank (1 = most likely) for every completion token, teacher-forced on prompt + completion. Logits at
    position j score token j+1, so the completion is scored by the last len(completion) positions."""
    ids = torch.tensor([list(prompt_ids) + list(completion_ids)])  # (1, P+C)
    with torch.no_grad():
        logp = (hf(ids).logits[0, :-1].double() / temperature).log_softmax(-1)  # (P+C-1, V)
    chosen = logp.gather(-1, ids[0, 1:, None])[:, 0]  # (P+C-1, 1) -> (P+C-1,)
    ranks = (logp > chosen[:, None]).sum(-1) + 1  # (P+C-1,)
    c = len(completion_ids)
    return chosen[-c:].tolist(), ranks[-c:].tolist()
