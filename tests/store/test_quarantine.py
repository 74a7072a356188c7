"""The quarantine list (records/quarantine.py, store/quarantine.py, ``gradloc-agent quarantine``,
integrations/quarantine.py): kept in the store, edited and exported by the CLI, read back by the loader-side
helpers so that a resumed run never sees those samples again — and refused when it would leave nothing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gradloc.agent.cli import main
from gradloc.records import QuarantineEntry
from gradloc.store import IncidentStore


def _cli(db: Path | str, *args: str):
    return CliRunner().invoke(main, ["quarantine", *args[:1], "--db", str(db), *args[1:]])


def test_the_store_keeps_one_entry_per_kind_and_value_the_first_reason_wins(target: Path | str) -> None:
    with IncidentStore(target) as store:
        q = store.quarantine
        first = QuarantineEntry(kind="origin", value="web-03.jsonl:17", reason="incident abc", added_unix=1.0,
                                job="j", step=40, incident_id="abc")
        assert q.add([first, QuarantineEntry(kind="source", value="forum", added_unix=2.0)]) == 2
        assert q.add([QuarantineEntry(kind="origin", value="web-03.jsonl:17", reason="again", added_unix=3.0)]) == 0
        assert q.list() == [first, QuarantineEntry(kind="source", value="forum", added_unix=2.0)]
        assert [e.value for e in q.list(job="j")] == ["web-03.jsonl:17"]
        assert q.remove("source", "forum") and not q.remove("source", "forum")


def test_the_cli_adds_lists_exports_and_removes(target: Path | str, tmp_path: Path) -> None:
    db = target
    IncidentStore(db).close()
    assert "quarantined: sample s180-3-1" in _cli(db, "add", "sample", "s180-3-1").output
    assert "already quarantined" in _cli(db, "add", "sample", "s180-3-1").output
    assert _cli(db, "add", "origin", "web.jsonl:9", "--reason", "garbage").exit_code == 0
    bad = _cli(db, "add", "origin", "x" * 10_000)
    assert bad.exit_code == 2 and "at most 512 characters" in bad.output
    listed = json.loads(_cli(db, "list", "--json").output)
    assert [(e["kind"], e["value"], e["reason"]) for e in listed] == [("sample", "s180-3-1", "by hand"),
                                                                     ("origin", "web.jsonl:9", "garbage")]
    out = tmp_path / "q.jsonl"
    assert "2 entries written" in _cli(db, "export", str(out)).output
    assert len(out.read_text().splitlines()) == 2
    assert _cli(db, "remove", "sample", "s180-3-1").exit_code == 0
    gone = _cli(db, "remove", "sample", "s180-3-1")
    assert gone.exit_code == 1 and "not quarantined" in gone.output


def test_a_resumed_run_never_sees_a_quarantined_sample_and_the_clean_data_is_untouched(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    from gradloc.integrations.provenance import with_provenance
    from gradloc.integrations.quarantine import EverySampleQuarantined, QuarantineList, QuarantineSampler

    web = with_provenance(datasets.Dataset.from_dict({"uid": [f"w{i}" for i in range(6)]}), source="web",
                          where="web.jsonl")
    forum = with_provenance(datasets.Dataset.from_dict({"uid": [f"f{i}" for i in range(4)]}), source="forum",
                            where="forum.jsonl")
    mixed = datasets.concatenate_datasets([web, forum]).shuffle(seed=1)
    lines = [json.dumps({"kind": "origin", "value": "web.jsonl:2"}), json.dumps({"kind": "sample", "value": "w5"}),
             json.dumps({"kind": "source", "value": "forum"}),
             "not json", json.dumps({"kind": "planet", "value": "x"}),  # malformed and unknown lines: counted
             json.dumps({"kind": "origin", "value": "o" * 600})]
    q = QuarantineList.parse(lines)
    assert q.bad_lines == 3 and len(q.entries) == 3
    kept = q.filter_dataset(mixed, id_column="uid")
    assert sorted(kept["uid"]) == ["w0", "w1", "w3", "w4"]  # every clean row, none of the quarantined
    assert q.skipped == {"origin": 1, "sample": 1, "source": 4}
    # the same list on a torch-style sampler over indices
    q2 = QuarantineList.parse(lines)
    key = lambda i: (mixed[i]["uid"], mixed[i]["gradloc_origin"], mixed[i]["gradloc_source"])  # noqa: E731
    sampler = QuarantineSampler(range(len(mixed)), q2, key)
    assert sorted(mixed[i]["uid"] for i in sampler) == ["w0", "w1", "w3", "w4"] and len(sampler) == 4
    # a list that would remove every sample is refused, never an empty loader
    every = QuarantineList.parse([json.dumps({"kind": "source", "value": s}) for s in ("web", "forum")])
    with pytest.raises(EverySampleQuarantined, match="would remove all 10 samples"):
        every.filter_dataset(mixed, id_column="uid")


def test_the_loader_reads_the_list_from_the_store_the_daemon_and_an_export_alike(tmp_path: Path) -> None:
    import urllib.error

    from gradloc.agent.core import AgentCore
    from gradloc.agent.http import AgentHttpServer
    from gradloc.integrations.quarantine import QuarantineList

    db = tmp_path / "q.db"
    store = IncidentStore(db)
    store.quarantine.add([QuarantineEntry(kind="origin", value="web.jsonl:9", reason="garbage", added_unix=1.0),
                          QuarantineEntry(kind="source", value="forum", added_unix=2.0)])
    out = tmp_path / "q.jsonl"
    assert _cli(db, "export", str(out)).exit_code == 0
    core = AgentCore(store=store).start()
    http = AgentHttpServer(core, "127.0.0.1:0").start()
    try:
        lists = [QuarantineList.load(out), QuarantineList.from_store(db),
                 QuarantineList.from_agent("%s:%d" % http.address)]
    finally:
        http.stop()
        core.close()
        store.close()
    assert all(q.entries == lists[0].entries and not q.bad_lines for q in lists) and len(lists[0].entries) == 2
    assert all(q.match(origin="web.jsonl:9") == "origin" and q.match(source="forum") == "source" for q in lists)
    nobody = AgentCore().start()  # a daemon without a store has no list: a clear error, before training
    http = AgentHttpServer(nobody, "127.0.0.1:0").start()
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            QuarantineList.from_agent("%s:%d" % http.address)
        assert err.value.code == 400
    finally:
        http.stop()
        nobody.close()
    with pytest.raises(Exception, match="no incident store"):
        QuarantineList.from_store(tmp_path / "missing.db")


def test_the_sampler_s_length_is_what_it_yields_or_an_upper_bound() -> None:
    """Issue 35's loader helper over the samplers a DataLoader is built with: exact where the order covers the
    dataset once or is the DistributedSampler's own, an upper bound (the wrapped length) where it is not."""
    import torch
    from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

    from gradloc.integrations.quarantine import QuarantineList, QuarantineSampler

    data = list(range(10))
    q = QuarantineList((*(QuarantineEntry(kind="sample", value=f"s{i}") for i in (1, 3, 5, 7)),))

    def key(i: int):
        return f"s{i}", None, None

    torch.manual_seed(0)
    for inner in (SequentialSampler(data), RandomSampler(data),
                  DistributedSampler(data, num_replicas=2, rank=0, shuffle=False),
                  DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)):
        s = QuarantineSampler(inner, q, key)
        got = list(s)
        assert len(s) == len(got) and not set(got) & {1, 3, 5, 7}, (type(inner).__name__, len(s), got)
    bounded = QuarantineSampler(RandomSampler(data, replacement=True, num_samples=4), q, key)
    assert len(bounded) == 4 >= len(list(bounded))
