"""Objects shaped like vLLM 0.32's generation outputs, for the RL demo and the join's unit tests.

The RL demo samples rollouts from its own policy on CPU without vLLM; it hands them to the same
join as real ``vllm.RequestOutput`` objects, so they carry the same attribute names and types
(``request_id``, ``prompt_token_ids``, ``outputs`` of ``CompletionOutput(index, token_ids,
logprobs=[{token_id: Logprob(logprob, rank, decoded_token)}], cumulative_logprob, finish_reason)``).
The real engine's objects go through the join in the vLLM test tier (tests/vllm_tier).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
