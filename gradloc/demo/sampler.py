"""The RL demo's rollout engine: the policy samples its own completions, returned as vLLM-shaped outputs.

Each prompt gets ``n`` completions sampled at temperature 1, token by token, until ``<eos>`` or
``max_new`` tokens, from the task's characters only (``SamplingParams(allowed_token_ids=...)``: never
pad or ``<bos>``). Every sampled token's log-prob is recorded as the sampler saw it (its own
forward over the growing prefix, not the trainer's forward over the padded or packed rows), with
its rank, like ``SamplingParams(logprobs=0)``: of the raw distribution over the whole vocabulary,
as vLLM's default ``logprobs_mode="raw_logprobs"`` reports it. The outputs carry vLLM 0.32's attribute names
(:mod:`gradloc.demo.vllm_shapes`), so they go through the same join as a real engine's.
"""
from __future__ import annotations

from typing import Sequence

import torch

from gradloc.demo.arith import EOS, SAMPLED, VOCAB, Problem, to_text
from gradloc.demo.vllm_shapes import CompletionOutput, Logprob, RequestOutput


@torch.no_grad()
def sample(model: torch.nn.Module, batch: Sequence[Problem], n: int, max_new: int, gen: torch.Generator,
           request_prefix: str = "", tail: tuple[int, float] | None = None) -> list[RequestOutput]:
    """``n`` completions of each problem's prompt, one ``RequestOutput`` per prompt.

    ``tail = (row, p_max)`` (the demo's ``advantage`` plant): completion ``row``'s first token is
    drawn from the policy's tail, the allowed tokens of probability ≤ ``p_max`` (the least likely one
    if there is none); the rest of it is sampled as usual, and its log-probs are reported as usual."""
    prompts = torch.tensor([p.prompt_ids for p in batch], dtype=torch.long)  # (Q, P): prompts share a length
    seq = prompts.repeat_interleave(n, dim=0)  # (Q, P) -> (Q·n, P): completions of a prompt are adjacent
    R = seq.shape[0]
    tokens: list[list[int]] = [[] for _ in range(R)]
    logps: list[list[tuple[float, int]]] = [[] for _ in range(R)]
    done = torch.zeros(R, dtype=torch.bool)
    allowed = torch.zeros(VOCAB)
    allowed[list(SAMPLED)] = 1.0
    for _ in range(max_new):
        logp = torch.log_softmax(model(seq)[:, -1].float(), dim=-1)  # (R, t, V) -> (R, V): the next token
        probs = logp.exp() * allowed  # (R, V)
        tok = torch.multinomial(probs, 1, generator=gen).squeeze(1)  # (R,)
        if tail is not None and seq.shape[1] == prompts.shape[1]:
            tok[tail[0]] = _from_tail(probs[tail[0]], tail[1], gen)
        lp = logp.gather(1, tok[:, None]).squeeze(1)  # (R,)
        rank = (logp > lp[:, None]).sum(1) + 1  # (R,): 1 = the most likely token, as vLLM counts
        for r in (~done).nonzero().flatten().tolist():
            tokens[r].append(int(tok[r]))
            logps[r].append((float(lp[r]), int(rank[r])))
        done |= tok == EOS
        seq = torch.cat([seq, tok[:, None]], dim=1)  # (R, t) -> (R, t + 1)
        if bool(done.all()):
            break
    return [RequestOutput(request_id=f"{request_prefix}p{q}", prompt=to_text(p.prompt_ids),
                          prompt_token_ids=p.prompt_ids,
                          outputs=[_completion(i, tokens[q * n + i], logps[q * n + i]) for i in range(n)])
            for q, p in enumerate(batch)]


def _from_tail(probs: torch.Tensor, p_max: float, gen: torch.Generator) -> int:
    """A token of probability ≤ ``p_max`` drawn in proportion to its probability; (V,) allowed-token probs."""
    low = torch.where((probs > 0) & (probs <= p_max), probs, 0.0)  # (V,)
    if float(low.sum()) <= 0:
        return int(torch.where(probs > 0, probs, torch.inf).argmin())
    return int(torch.multinomial(low, 1, generator=gen))


def _completion(index: int, tokens: list[int], logps: list[tuple[float, int]]) -> CompletionOutput:
    stopped = bool(tokens) and tokens[-1] == EOS
    return CompletionOutput(
        index=index, text=to_text(tokens[:-1] if stopped else tokens), token_ids=list(tokens),
        cumulative_logprob=sum(lp for lp, _ in logps),
        logprobs=[{t: Logprob(lp, rank, to_text([t]))} for t, (lp, rank) in zip(tokens, logps)],
        finish_reason="stop" if stopped else "length")
