"""Provenance of Megatron-core's packed GPT rows (gradloc/integrations/megatron_data.py) on megatron-core's own
``IndexedDatasetBuilder``, ``GPTDataset``, ``BlendedDataset`` (built by ``BlendedMegatronDatasetBuilder``) and
torch's ``DataLoader`` with its default collation; indexed datasets written to tmp. Nothing is mocked.

Every row is resolved position by position against the tokens Megatron returns (documents whose tokens encode
their own document and index), a row packed from hundreds of documents stays under the origin limit and still
resolves its first and last documents, and a Megatron-style loop over the tiny pre-trained Llama (a plain
``gradloc.watch`` monitor, as Megatron's own loop would use it) localizes a corrupted token planted in one
document: the incident's culprit names the blend component and the planted document and token.
"""
from __future__ import annotations

import os

import numpy
import pytest
import torch

pytest.importorskip("megatron.core.datasets.gpt_dataset")

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # noqa: E402
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer  # noqa: E402

import gradloc  # noqa: E402
from gradloc.agent.render import incident_text  # noqa: E402
from gradloc.config import DetectorConfig, WatchConfig  # noqa: E402
from gradloc.integrations.megatron_data import MegatronProvenance, document_at, pop_sample_infos  # noqa: E402
from gradloc.integrations.provenance import ORIGIN, SOURCE  # noqa: E402
from gradloc.records import MAX_ORIGIN, SampleInfo  # noqa: E402
from tests.helpers import single_thread  # noqa: E402,F401 (autouse fixture)
from tests.tiny_llama import PROMPT, SEQ, World, causal_lm, pretrained  # noqa: E402

CODE = 1000  # synthetic token of document d, index t: d * CODE + t (+ BASE of its dataset)


def write(path: str, docs: list[list[int]], dtype=numpy.int32) -> str:
    """An indexed dataset (.bin/.idx) holding ``docs``, as Megatron's preprocess_data writes one."""
    b = IndexedDatasetBuilder(path + ".bin", dtype=dtype)
    for d in docs:
        b.add_document(torch.tensor(d, dtype=torch.int64), [len(d)])
    b.finalize(path + ".idx")
    return path


def build(prefixes: list[str], weights: list[float] | None, seq: int, size: int, vocab: int, cache: str,
          seed: int = 1):
    """The train split as Megatron builds it: a BlendedDataset of GPTDatasets (a GPTDataset for one prefix)."""
    blend = (prefixes, weights)
    cfg = GPTDatasetConfig(random_seed=seed, sequence_length=seq, blend=blend, split="100,0,0",
                           tokenizer=NullTokenizer(vocab), reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, path_to_cache=cache, mid_level_dataset_surplus=0.005)
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [size, 0, 0], lambda: True, cfg).build()
    return train


@pytest.fixture(scope="module")
def coded(tmp_path_factory):
    """Two components whose tokens say where they come from: web (base 0) and code (base 500 000)."""
    d = tmp_path_factory.mktemp("coded")
    rng = numpy.random.default_rng(0)
    prefixes = []
    for name, base, n in (("web", 0, 40), ("code", 500_000, 25)):
        docs = [[base + k * CODE + t for t in range(int(rng.integers(2, 14)))] for k in range(n)]
        prefixes.append(write(str(d / f"{name}_text_document"), docs))
    return build(prefixes, [0.6, 0.4], seq=16, size=60, vocab=10**6, cache=str(d / "cache")), prefixes


def test_every_position_resolves_to_the_document_and_token_megatron_packed_there(coded):
    train, prefixes = coded
    ds = MegatronProvenance(train)
    assert ds.sources == ["web_text_document", "code_text_document"]
    multi = 0
    for i in range(len(ds)):
        row = ds[i]
        which = int(row["dataset_id"])
        assert row[SOURCE] == ds.sources[which] and row[ORIGIN].startswith(prefixes[which] + " docs ")
        info = SampleInfo(source=row[SOURCE], origin=row[ORIGIN])
        multi += "," in row[ORIGIN]
        for p, label in enumerate(row["labels"].tolist()):  # position p scores labels[p] (token p + 1)
            at = document_at(info, p)
            base = 500_000 if which else 0
            assert at is not None and at.where == prefixes[which]
            assert base + at.document * CODE + at.token == label, (i, p, row[ORIGIN])
    assert multi > len(ds) // 2  # most rows are packed from several documents
    assert ds.dropped == 0


def test_default_collation_gives_lists_that_become_one_sample_info_per_row(coded):
    train, _ = coded
    loader = torch.utils.data.DataLoader(MegatronProvenance(train, sources=["web", "code"]), batch_size=4)
    batch = next(iter(loader))
    assert isinstance(batch[SOURCE], list) and len(batch[ORIGIN]) == 4
    rest, infos = pop_sample_infos(batch)
    assert SOURCE not in rest and ORIGIN not in rest and set(rest) >= {"tokens", "labels", "loss_mask"}
    assert [i.source for i in infos] == [["web", "code"][int(x)] for x in batch["dataset_id"]]
    assert [i.origin for i in infos] == batch[ORIGIN]


def test_a_row_of_hundreds_of_documents_keeps_its_first_and_last_and_stays_under_the_limit(tmp_path):
    docs = [[k * CODE + t for t in range(1 + k % 2)] for k in range(3000)]  # documents of 1–2 tokens
    deep = tmp_path.joinpath(*["a-rather-long-directory-name"] * 10)  # a prefix of ~330 characters
    deep.mkdir(parents=True)
    prefix = write(str(deep / "tiny_text_document"), docs)
    gpt = build([prefix], None, seq=1024, size=3, vocab=10**7, cache=str(tmp_path / "cache"))
    ds = MegatronProvenance(gpt)
    for i in range(len(ds)):
        row = ds[i]
        origin = row[ORIGIN]
        assert len(origin) <= MAX_ORIGIN and "…" in origin.split(" docs ")[1]
        assert origin.startswith("…") and prefix.endswith(origin.split(" docs ")[0][1:])  # the path's tail
        labels = row["labels"].tolist()
        known = [p for p in range(len(labels)) if document_at(origin, p) is not None]
        assert 0 in known and len(labels) - 1 in known and len(known) < len(labels)  # first, last; not the middle
        for p in known:
            at = document_at(origin, p)
            assert at.document * CODE + at.token == labels[p]


def test_an_unreadable_row_keeps_a_plain_origin_and_is_counted(coded, monkeypatch):
    train, prefixes = coded
    ds = MegatronProvenance(train)
    gpt = train.datasets[0]
    real, calls = gpt._query_document_sample_shuffle_indices, []

    def flaky(idx):  # the sample reads fine; the provenance read then fails (a vanished mmap, say)
        calls.append(idx)
        if len(calls) % 2 == 0:
            raise OSError("the index file went away")
        return real(idx)

    monkeypatch.setattr(gpt, "_query_document_sample_shuffle_indices", flaky)
    i = next(i for i in range(len(train)) if int(train.dataset_index[i]) == 0)
    row = ds[i]
    assert row[ORIGIN] == f"{prefixes[0]} sample {int(train.dataset_sample_index[i])}" and ds.dropped == 1
    assert document_at(row[ORIGIN], 0) is None


def test_bad_setup_is_refused_before_training(coded):
    train, _ = coded
    with pytest.raises(gradloc.BatchMetadataError, match="2 blend components"):
        MegatronProvenance(train, sources=["one"])
    with pytest.raises(gradloc.BatchMetadataError, match="source must be"):
        MegatronProvenance(train, sources=["s" * 65, "code"])
    with pytest.raises(gradloc.BatchMetadataError, match="not a Megatron GPTDataset"):
        MegatronProvenance(list(range(3)))


# -- a Megatron-style loop: the planted document is named by the incident -------------------------------
B, GA, K, MB, ROW = 4, 2, 12, 1, 2
STEPS = K + 3
PLANTED_DOC, Z_AT = 31, 28  # forum's document 31, its token 4, is "Z" (a byte the corpus never has)


def quiet(batch: dict) -> dict:
    """The batch with its first PROMPT positions out of the loss (as the HF tests' rows): with no context yet,
    their predictions are noise that would hide the planted token's spike in this tiny model."""
    mask = batch["loss_mask"].clone()
    mask[:, :PROMPT] = 0
    return {**batch, "loss_mask": mask}


def token_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Megatron's GPT loss per token: cross-entropy of the logits against ``labels`` (already shifted), masked
    by ``loss_mask``, over the micro-batch's loss tokens. (B, T)."""
    logits = model(input_ids=batch["tokens"]).logits.float()
    terms = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
    mask = batch["loss_mask"].float()
    return terms * mask / mask.sum()


@pytest.fixture(scope="module")
def world() -> World:
    return pretrained(60)


@pytest.fixture(scope="module")
def corpus(world, tmp_path_factory):
    """forum and wiki: 60 documents each, every one the corpus's whole sentence pair (35 tokens), which the model
    knows — so a row packed across a document boundary reads on as the corpus does, and the only surprise is
    forum's PLANTED_DOC, whose token Z_AT is Z."""
    d = tmp_path_factory.mktemp("corpus")
    stream = world.cycle[:world.period].tolist()
    prefixes = []
    for name in ("forum", "wiki"):
        docs = [list(stream) for _ in range(60)]
        if name == "forum":
            docs[PLANTED_DOC][Z_AT] = world.tok.convert_tokens_to_ids("Z")
        prefixes.append(write(str(d / f"{name}_text_document"), docs, dtype=numpy.uint16))
    train = build(prefixes, [0.5, 0.5], seq=SEQ, size=160, vocab=len(world.tok) + 1, cache=str(d / "cache"))
    return MegatronProvenance(train), prefixes


def test_a_megatron_loop_s_incident_names_the_planted_document(world, corpus):
    ds, prefixes = corpus
    z = world.tok.convert_tokens_to_ids("Z")
    dirty = [i for i in range(len(ds)) if z in ds.dataset[i]["tokens"].tolist() + ds.dataset[i]["labels"].tolist()]
    planted = next(i for i in dirty if z in ds.dataset[i]["labels"].tolist()
                   if PROMPT + 2 <= ds.dataset[i]["labels"].tolist().index(z) < SEQ - 2)
    order = [i for i in range(len(ds)) if i not in dirty][:STEPS * GA * B - 1]
    order.insert((K * GA + MB) * B + ROW, planted)  # the loop sees the planted row once, at step K
    loader = torch.utils.data.DataLoader(ds, batch_size=B, sampler=order)  # default collation

    model = causal_lm(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = gradloc.watch(model, opt, config=WatchConfig(job="megatron-test", store=False,
                                                       detector=DetectorConfig(warmup=8)))
    batches = iter(loader)
    for _ in range(STEPS):
        parts, loss = [], 0.0
        for _ in range(GA):
            batch, infos = pop_sample_infos(next(batches))  # the two string lists become SampleInfos here
            batch = quiet(batch)
            with mon.micro_batch(batch["labels"], loss_mask=batch["loss_mask"].bool(), sample_infos=infos):
                mb_loss = token_loss(model, batch).sum() / GA
                mb_loss.backward()
            parts.append(batch)
            loss = loss + mb_loss.detach()

        def probe(i: int, token_mask: torch.Tensor) -> torch.Tensor:
            return (token_loss(model, parts[i]) * token_mask).sum() / GA

        mon.end_step(loss, probe=probe)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    mon.close()

    assert [i.step for i in mon.incidents] == [K], [(i.step, i.spike.kinds) for i in mon.incidents]
    loc = mon.incidents[0].localization
    assert loc.status == "located", loc
    span = next(s for s in loc.spans if (s.micro_batch, s.sample) == (MB, ROW))
    info = span.sample_info
    assert info.source == "forum_text_document" and info.origin.startswith(prefixes[0] + " docs ")
    q = ds.dataset[planted]["labels"].tolist().index(z)  # the position scoring Z
    assert span.start <= q < span.end
    at = document_at(info, q)
    assert (at.where, at.document, at.token) == (prefixes[0], PLANTED_DOC, Z_AT)
    text = incident_text(mon.incidents[0], color=False)
    assert f"document {PLANTED_DOC}, its token" in text and "forum_text_document ·" in text
    assert os.path.basename(prefixes[0]) == "forum_text_document"
