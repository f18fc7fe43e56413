"""LR schedule against hand-computed values."""
import math

import pytest

from mindvl_ms.train.lr import WarmupCosine


def test_warmup_then_cosine_hand_values():
    s = WarmupCosine(max_lr=1.0, min_lr=0.1, total_steps=10, warmup_ratio=0.2)  # 2 warm-up steps
    assert s.warmup == 2
    assert s(0) == pytest.approx(0.5)
    assert s(1) == pytest.approx(1.0)
    assert s(2) == pytest.approx(1.0)                       # first decay step: the peak
    # p = (5 - 2) / 7 -> 0.1 + 0.9 * (1 + cos(pi * 3/7)) / 2
    assert s(5) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 3 / 7)))
    assert s(9) == pytest.approx(0.1)                       # last step: exactly the minimum
    vals = s.values()
    assert all(a >= b for a, b in zip(vals[2:], vals[3:]))  # monotone decay


def test_constant_and_no_warmup():
    s = WarmupCosine(2.5e-6, 2.5e-6, 7, 0.0)               # openPangu-VL annealing: constant LR
    assert s.values() == pytest.approx([2.5e-6] * 7)
    s = WarmupCosine(1e-3, 0.0, 3, 0.0)
    assert s.values() == pytest.approx([1e-3, 5e-4, 0.0])


def test_bad_arguments():
    with pytest.raises(ValueError):
        WarmupCosine(1.0, 0.0, 0, 0.1)
    with pytest.raises(ValueError):
        WarmupCosine(1.0, 0.0, 5, 0.1)(-1)
