"""Rank coordinates: hand-computed cases for the MindSpore device-matrix order."""
import pytest

from mindvl_ms.config.base import ConfigError
from mindvl_ms.parallel import Layout


def test_coords_8b_64npu():
    lay = Layout(dp=16, tp=4, pp=1)
    c = lay.coords(23)                      # 23 = 5 * 4 + 3
    assert (c.pp, c.dp, c.tp) == (0, 5, 3)
    assert lay.tp_group(23) == [20, 21, 22, 23]
    assert lay.dp_group(23) == list(range(3, 64, 4))
    # every dp index is read by exactly tp ranks, never beyond dp_size (ranks 16-63 used to overflow)
    dps = [lay.coords(r).dp for r in range(64)]
    assert max(dps) == 15 and all(dps.count(d) == 4 for d in range(16))


def test_coords_pipeline_and_experts():
    lay = Layout(dp=16, tp=4, pp=16, ep=64)
    assert lay.world == 1024
    c = lay.coords(64 * 3 + 4 * 7 + 2)      # stage 3, dp 7, tp 2
    assert (c.pp, c.dp, c.tp, c.ep) == (3, 7, 2, 30)
    assert lay.pp_group(c.rank) == [64 * s + 30 for s in range(16)]
    assert lay.ep_group(c.rank) == list(range(192, 256))
    small = Layout(dp=4, tp=2, ep=4)
    assert small.ep_group(5) == [4, 5, 6, 7] and small.coords(6).ep == 2
    assert sorted(r for r in range(8) if small.coords(r).ep == 1) == [1, 5]


def test_bad_layouts():
    with pytest.raises(ConfigError, match="expert_parallel 3 must divide"):
        Layout(dp=2, tp=2, ep=3)
    with pytest.raises(ValueError, match="outside"):
        Layout(dp=2).coords(2)
