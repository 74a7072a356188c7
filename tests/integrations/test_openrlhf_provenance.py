"""OpenRLHF provenance (``PromptProvenance``, gradloc/integrations/openrlhf_batch.py) on OpenRLHF 0.11's own
``PromptDataset`` and ``Experience`` (``concat_experiences``) (no ray, deepspeed or vllm at import): each rollout
row is matched to its prompt's datasource and dataset index by the prompt text, padded or packed, each sequence
keeping its own SampleInfo and its spans. The planted culprit through ``GradlocOpenRLHF``: tests/integrations/
test_openrlhf.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("openrlhf.trainer.ppo_utils.experience")

from openrlhf.datasets.prompts_dataset import PromptDataset  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402

from gradloc.collector.batch import make_meta  # noqa: E402
from gradloc.errors import BatchMetadataError  # noqa: E402
from gradloc.integrations.openrlhf import PromptProvenance, layout  # noqa: E402

ROWS = [{"input": "What is 2+2?", "datasource": "gsm8k"}, {"input": "Integrate x dx.", "datasource": "math"},
        {"input": "Name a prime.", "datasource": "gsm8k"}, {"input": "Hello?"},  # no datasource: "default"
        {"input": "What is 2+2?", "datasource": "gsm8k"},  # the same prompt twice, same source: no index
        {"input": "Name a prime.", "datasource": "math"}]  # twice, different sources: neither


def prompt_dataset(rows: list[dict]) -> PromptDataset:
    """OpenRLHF's PromptDataset as its PPO trainer builds it (input_key, no chat template)."""
    strategy = SimpleNamespace(args=SimpleNamespace(data=SimpleNamespace(input_key="input", label_key=None,
                                                                         apply_chat_template=False)),
                               is_rank_0=lambda: True)
    return PromptDataset(rows, None, strategy)


def experience(prompt: str, n_prompt: int, n_response: int) -> Experience:
    """One rollout as OpenRLHF's samples generator makes it (sequences, attention, action_mask = mask[1:])."""
    seq = torch.arange(1, n_prompt + n_response + 1)
    action = torch.zeros(n_prompt + n_response, dtype=torch.long)
    action[n_prompt:] = 1
    return Experience(sequences=seq[None], attention_mask=torch.ones_like(seq)[None], action_mask=action[1:][None],
                      prompts=[prompt], labels=[""], response_length=torch.tensor([n_response]),
                      truncated=torch.tensor([False]))


def batch(rollouts: list[Experience]) -> Experience:
    """A micro-batch as OpenRLHF's experience maker concatenates rollouts: right-padded (B, T), prompts kept."""
    return Experience.concat_experiences(rollouts, pad_token_id=0)


@pytest.mark.parametrize("packed", [False, True])
def test_each_rollout_row_gets_its_prompt_s_datasource_and_index(packed):
    ds = prompt_dataset(ROWS)
    assert ds.datasources == ["gsm8k", "math", "gsm8k", "default", "gsm8k", "math"]  # what OpenRLHF reads
    prov = PromptProvenance(ds, where="prompts.jsonl")
    rollouts = [("Integrate x dx.", 3, 4), ("What is 2+2?", 5, 2), ("Hello?", 2, 3), ("Name a prime.", 4, 1),
                ("never seen", 2, 2)]
    exp = batch([experience(*r) for r in rollouts])
    assert exp.prompts == [r[0] for r in rollouts]
    lay = layout(exp, packed=packed, provenance=prov(exp))
    assert [(i.source, i.origin) for i in lay.infos] == [("math", "prompts.jsonl:1"), ("gsm8k", None),
                                                         (None, "prompts.jsonl:3"), (None, None), (None, None)]
    meta = make_meta(0, lay.token_ids, lay.loss_mask, None, None, lay.cu_seqlens, sample_infos=lay.infos)
    for i, (_, p, r) in enumerate(rollouts):  # every response token's position: its own sequence's info
        assert lay.infos[i].response_tokens == r and lay.infos[i].prompt_tokens == p  # the spans are kept
        for j in exp.action_mask[i].nonzero().reshape(-1).tolist():
            sample, _ = meta.locate(int(lay.action_index[i, j]))
            assert sample == i and meta.sample_info(sample) == lay.infos[i]
    assert meta.packed == packed


def test_bad_prompt_data_is_refused_before_training_and_ragged_rows_change_nothing():
    with pytest.raises(BatchMetadataError, match="source must be"):
        PromptProvenance(prompt_dataset([{"input": "a", "datasource": "d" * 65}]))
    with pytest.raises(BatchMetadataError, match="origin must be"):
        PromptProvenance(prompt_dataset(ROWS), where="w" * 600)
    exp = batch([experience("What is 2+2?", 3, 2), experience("Hello?", 2, 2)])
    plain = layout(exp).infos
    assert layout(exp, provenance=[("gsm8k", "p:0")]).infos == plain  # one row of two: left as it was
    exp.prompts = None
    assert PromptProvenance(prompt_dataset(ROWS))(exp) is None
