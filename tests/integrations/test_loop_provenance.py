"""Provenance through the loop integrations: a real ``lightning.pytorch.Trainer`` with GradlocCallback, and a real
``accelerate.Accelerator`` loop with GradlocAccelerate, each around an HF model called as ``model(**batch)``.

The rows are the HF Trainer tests' (tests/tiny_llama.py: the planted corrupted token in one row of step K). Under
Lightning they come through HF ``datasets`` with ``with_provenance`` and ``ProvenanceCollator``; under Accelerate
as plain rows carrying the provenance columns, collated by torch's ``default_collate`` into lists (the form
Megatron's loader gives, gradloc/integrations/megatron_data.py). Either way the integration takes the provenance
out of the batch before the user's code sees it, and the incident's culprit names the planted row's origin.
Nothing is mocked.
"""
from __future__ import annotations

import pytest
import torch

datasets = pytest.importorskip("datasets")
pl = pytest.importorskip("lightning.pytorch")
pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from transformers import default_data_collator  # noqa: E402

from gradloc.config import DetectorConfig  # noqa: E402
from gradloc.integrations.accelerate import GradlocAccelerate  # noqa: E402
from gradloc.integrations.lightning import GradlocCallback, causal_lm_token_loss  # noqa: E402
from gradloc.integrations.provenance import ORIGIN, SAMPLE_INFOS, SOURCE, ProvenanceCollator, with_provenance  # noqa: E402
from gradloc.records import SampleInfo  # noqa: E402
from tests.helpers import single_thread  # noqa: E402,F401 (autouse fixture)
from tests.tiny_llama import World, causal_lm, pretrained, rows  # noqa: E402

B, GA = 4, 2
K, MB, ROW, POS = 12, 1, 2, 17  # planted: step K, micro-batch MB, row ROW, input index POS
STEPS = K + 3
PLANTED = (K * GA + MB) * B + ROW  # the loaders feed rows in order
BAD = 3 * GA * B + 1  # Accelerate: this row's origin column breaks the 512-character limit
GRADLOC = dict(store=False, detector=DetectorConfig(warmup=8))


@pytest.fixture(scope="module")
def world() -> World:
    return pretrained(60)


@pytest.fixture(scope="module")
def data(world: World) -> list[dict]:
    """The HF tests' rows without their uid: ``model(**batch)`` takes every key of the batch."""
    return [{k: v for k, v in r.items() if k != "uid"} for r in rows(world, STEPS * GA * B, plant_row=PLANTED, pos=POS)]


def culprit_info(mon) -> SampleInfo:
    assert [i.step for i in mon.incidents] == [K], [(i.step, i.spike.kinds) for i in mon.incidents]
    loc = mon.incidents[0].localization
    assert loc.status == "located" and 1 <= loc.probes <= 3, loc
    top = loc.culprits[0]
    assert (top.micro_batch, top.sample) == (MB, ROW) and POS - 1 in {c.position for c in loc.culprits}
    (info,) = {s.sample_info for s in loc.spans if (s.micro_batch, s.sample) == (MB, ROW)}
    return info


class LitHF(pl.LightningModule):
    """An HF causal LM trained the HF way, ``self.model(**batch)``; records the keys each step's batch had."""

    def __init__(self, w: World) -> None:
        super().__init__()
        self.model, self.seen = causal_lm(w), []

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.seen.append(("train", frozenset(batch)))
        return self.model(**batch).loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.seen.append(("val", frozenset(batch)))
        self.model(**batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def gradloc_token_loss(self, batch: dict) -> torch.Tensor:
        return causal_lm_token_loss(self.model(input_ids=batch["input_ids"]).logits, batch["labels"])


def test_lightning_takes_the_collator_s_infos_out_of_the_batch_and_the_culprit_names_its_origin(world, data):
    table = datasets.Dataset.from_list([{k: v.tolist() for k, v in r.items()} for r in data])
    ds = with_provenance(table, source="forum", where="forum-03.jsonl", tags={"lang": "en"})
    collate = ProvenanceCollator(default_data_collator)
    train = torch.utils.data.DataLoader(ds, batch_size=B, shuffle=False, collate_fn=collate)
    val = torch.utils.data.DataLoader(ds.select(range(B)), batch_size=B, collate_fn=collate)
    module, cb = LitHF(world), GradlocCallback(dict(job="lightning-provenance", **GRADLOC))
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         max_steps=STEPS, accumulate_grad_batches=GA, gradient_clip_val=1.0, callbacks=[cb],
                         val_check_interval=10, limit_val_batches=1)
    trainer.fit(module, train, val)
    kinds = [kind for kind, _ in module.seen]
    assert kinds.count("train") == STEPS * GA and kinds.count("val") == 3  # validation every 10 batches
    assert all(keys == {"input_ids", "attention_mask", "labels"} for _, keys in module.seen)  # never SAMPLE_INFOS
    mon = cb.monitor
    assert not mon.counters, mon.counters
    assert culprit_info(mon) == SampleInfo(source="forum", origin=f"forum-03.jsonl:{PLANTED}", tags={"lang": "en"})


def test_accelerate_takes_collated_provenance_columns_out_of_the_batch_and_counts_a_bad_row(world, data):
    rows_ = [{**r, SOURCE: "forum", ORIGIN: f"forum-03.jsonl:{i}"} for i, r in enumerate(data)]
    rows_[BAD][ORIGIN] = "o" * 600  # written by hand past the limit: that row keeps none, training goes on
    AcceleratorState._reset_state(True)  # a fresh Accelerator (its state is process-wide)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=GA)
    model = causal_lm(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(rows_, batch_size=B, shuffle=False)  # torch's default_collate
    model, opt, loader = acc.prepare(model, opt, loader)
    token_loss = lambda m, b: causal_lm_token_loss(m(input_ids=b["input_ids"]).logits, b["labels"])  # noqa: E731
    gl = GradlocAccelerate(acc, model, opt, token_loss=token_loss, job="accelerate-provenance", **GRADLOC)
    seen = []
    for batch in loader:
        assert isinstance(batch[ORIGIN], list)  # the collated columns: one string per row
        with gl.accumulate(batch):
            seen.append(set(batch))
            loss = model(**batch).loss
            gl.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    gl.close()
    assert len(seen) == STEPS * GA and all(k == {"input_ids", "attention_mask", "labels"} for k in seen)
    mon = gl.monitor
    assert dict(mon.counters) == {"integration_provenance_dropped": 1}
    assert culprit_info(mon) == SampleInfo(source="forum", origin=f"forum-03.jsonl:{PLANTED}")
    assert SAMPLE_INFOS not in seen[0]
