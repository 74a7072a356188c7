"""|log π_train − log π_vllm| for an engine dtype against the float32 trainer, same weights.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m tests.vllm_tier.inside.measure_gap bfloat16

Prints the token count, median, p99 and max of the gap over 8 prompts × n=4 × ≤16 tokens at T=1.
A measurement, not a test (one engine per process: each dtype needs its own run).
"""
from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import torch

from tests.vllm_tier.inside import engine


def main(dtype: str) -> None:
    model_dir = engine.build_model_dir(Path(tempfile.mkdtemp(prefix="tiny-llama-")))
    llm = engine.start_engine(model_dir, dtype=dtype)
    hf = engine.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gaps = []
    for out in engine.rollouts(llm, engine.PROMPTS, n=4, max_tokens=16, logprobs=0):
        for c in out.outputs:
            train, _ = engine.teacher_forced_logprobs(hf, out.prompt_token_ids, c.token_ids)
            gaps += [abs(lp - pos[t].logprob) for t, pos, lp in zip(c.token_ids, c.logprobs, train)]
    gaps.sort()
    print(f"engine dtype {dtype} vs float32 trainer, {len(gaps)} tokens: median {statistics.median(gaps):.2e}, "
          f"p99 {gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]:.2e}, max {gaps[-1]:.2e}")
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "float32")
