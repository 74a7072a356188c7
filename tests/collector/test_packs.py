"""collector/packs.py: the named layouts every packed vector goes through (no hand-counted offsets)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gradloc.collector.packs import Pack, layer_pack, summed_update_pack, update_pack
from gradloc.collector.rl_fields import RL_PACK, unpack_rl
from gradloc.collector.surprise import ROWS, pack_layout, surprise_pack


def test_build_get_segment_and_split_agree():
    lay = Pack.of(a=2, b=3, c=1)
    v = lay.build(a=torch.tensor([1.0, 2.0]), b=torch.tensor([3.0, 4.0, 5.0]), c=torch.tensor(6.0))
    assert v.tolist() == [1, 2, 3, 4, 5, 6] and len(lay) == 6
    assert lay.get(v, "b").tolist() == [3, 4, 5] and lay.scalar(v, "c") == 6.0
    assert lay.segment(v, "a", "b").tolist() == [1, 2, 3, 4, 5]
    assert lay.segment(v.numpy(), "b", "c").tolist() == [3, 4, 5, 6]  # host arrays too
    assert {k: x.tolist() for k, x in lay.split(v).items()} == {"a": [1, 2], "b": [3, 4, 5], "c": [6]}
    with pytest.raises(KeyError):
        lay.segment(v, "b", "a")
    with pytest.raises(ValueError):
        lay.split(v[:5])
    with pytest.raises(ValueError):
        lay.build(a=torch.zeros(3), b=torch.zeros(3), c=torch.zeros(1))  # a field of the wrong length


def test_a_summed_update_is_the_update_pack_then_a_count():
    L = 4
    sums = summed_update_pack(L)
    v = np.arange(len(sums), dtype=float)
    assert len(sums) == len(update_pack(L)) + 1 and sums.scalar(v, "ranks") == 3 * L
    assert sums.segment(v, "delta_sq", "elements").tolist() == list(range(3 * L))
    assert len(layer_pack(L)) == 4 * L + 1


def test_the_surprise_and_rl_layouts():
    """The judge reads the surprise pack by name, its offset rows counted from the pack's length; the RL pack's
    length is its layout's."""
    M, S = 2, 5
    for rows in (0, 16 * 2):
        lay = surprise_pack(M, S, rows)
        assert len(lay) == M + (ROWS + rows) * S and pack_layout(len(lay), M, S) == lay
    host = np.zeros(len(RL_PACK))  # the RL pack read back by name: 4 tokens, entropy 2.0 in all
    host[RL_PACK.span("tokens")] = 4
    host[RL_PACK.span("present")] = [0, 0, 0, 0, 1]  # entropy given
    host[RL_PACK.span("entropy")] = 2.0
    st = unpack_rl(host)
    assert st.tokens == 4 and st.entropy_mean == 0.5 and st.advantage_rms is None


def test_the_job_s_rl_entropy_and_kl_are_one_process_s_over_every_rank_s_tokens() -> None:
    """rl_fields.job_rl over the ranks' JOB_RL rows (the step gather's) against the RL pack of their tokens in one."""
    from gradloc.collector.rl_fields import job_rl, job_rl_row, rl_pack

    g = torch.Generator().manual_seed(0)
    given = {"logp", "rollout_logp", "advantages", "entropy"}

    def fields(n: int) -> dict:
        return {"has": torch.ones(n, dtype=torch.bool), "old_logp": torch.full((n,), float("nan")),
                "logp": -torch.rand(n, generator=g), "rollout_logp": -torch.rand(n, generator=g),
                "advantages": torch.randn(n, generator=g), "clipped": torch.zeros(n, dtype=torch.bool),
                "entropy": torch.rand(n, generator=g) * 3}

    ranks = [fields(7), fields(12)]
    eligible = [torch.rand(len(f["has"]), generator=g) > 0.3 for f in ranks]
    rows = torch.stack([job_rl_row(rl_pack(f, e, given), torch.device("cpu")) for f, e in zip(ranks, eligible)])
    union = {k: torch.cat([f[k] for f in ranks]) for k in ranks[0]}
    whole = unpack_rl(rl_pack(union, torch.cat(eligible), given).numpy())
    entropy, kl = job_rl(rows.numpy())
    assert entropy == pytest.approx(whole.entropy_mean, rel=1e-12) and kl == pytest.approx(whole.kl_rollout, rel=1e-12)
    alone = job_rl(torch.stack([rows[0], job_rl_row(None, torch.device("cpu"))]).numpy())  # a rank without RL
    one = unpack_rl(rl_pack(ranks[0], eligible[0], given).numpy())
    assert alone == pytest.approx((one.entropy_mean, one.kl_rollout), rel=1e-12)
    assert job_rl(np.zeros((2, 4))) == (None, None)
