"""Dense-and-sparse outliers (simulated): each block keeps exactly its count, the planted outliers are the
ones kept, sinks are never chosen, the dense part no longer stretches its groups' ranges, and the bits
are counted."""

import pytest
import torch

from torch_rkv import outliers
from torch_rkv import scheme as S
from torch_rkv.eval.simulate import Simulation


def planted(seed=0, n=256, d=64):
    x = torch.randn(1, 2, n, d, generator=torch.Generator().manual_seed(seed))
    spots = [(0, 5, 3), (0, 130, 60), (1, 77, 10), (1, 200, 0)]
    for h, t, c in spots:
        x[0, h, t, c] = 40.0
    return x, spots


def test_each_block_keeps_its_count_and_the_planted_outliers():
    x, spots = planted()
    dense, mask = outliers.split(x, 0.01, 128, 1, 128)  # per-channel groups of 128 tokens
    k = outliers.outlier_count(0.01, 128, 64)
    assert k == 82 and mask.reshape(1, 2, 2, -1).sum(-1).tolist() == [[[k, k], [k, k]]]
    for h, t, c in spots:
        assert mask[0, h, t, c] and dense[0, h, t, c] != 40.0
    assert torch.equal(dense[~mask], x[~mask])
    back = outliers.merge(torch.zeros_like(x), x, mask)
    assert torch.equal(back[mask], x[mask].half().float())


def test_sinks_are_never_chosen():
    x, _ = planted()
    x[0, :, 1, :] = 100.0  # sink row 1: the most outlying of all
    _, mask = outliers.split(x, 0.01, 128, 64, 1, skip_rows=4)  # per-token groups
    assert not mask[:, :, :4].any()


def test_the_dense_part_gets_a_finer_grid():
    """Per-channel 2-bit keys with one planted spike per channel: keeping the spikes aside shrinks every
    other value's error, by far more than the spike costs in bits."""
    x = torch.randn(1, 1, 128, 64, generator=torch.Generator().manual_seed(1))
    x[0, 0, 17] += 30.0  # one token spikes in every channel
    base = S.Scheme(name="k2", k_bits=2, v_bits=2, k_group_size=1, k_block_tokens=128)
    plain = Simulation(base, view="all").round_trip(x, "k", base)
    sparse_scheme = base.replace(outliers=64 / (128 * 64))
    sparse = Simulation(sparse_scheme, view="all").round_trip(x, "k", sparse_scheme)
    rest = torch.ones(128, dtype=torch.bool)
    rest[17] = False
    err = lambda y: (y - x)[0, 0, rest].pow(2).mean().item()  # noqa: E731
    assert err(sparse) < err(plain) / 20
    assert torch.allclose(sparse[0, 0, 17], x[0, 0, 17].half().float())
    assert sparse_scheme.effective_bits(64) == base.effective_bits(64) + 64 * 32 / (128 * 64)


def test_outliers_are_simulated_only_and_bounded():
    with pytest.raises(NotImplementedError, match="sparse outliers"):
        S.recommended(2).replace(outliers=0.01).check_served()
    with pytest.raises(ValueError, match="outliers"):
        S.recommended(2).replace(outliers=0.5)
    assert "1.0% outliers in fp16" in S.recommended(2).replace(outliers=0.01).describe(64)
