"""Logits processing for sampling against transformers' own processors (repetition penalty, temperature,
top-k, top-p), on random logits. Run: pytest tests/infer/test_sampling.py
"""
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                                                    TopKLogitsWarper, TopPLogitsWarper)

from mindvl_ms.infer.sampling import SamplingConfig, choose, process_logits


@pytest.mark.parametrize("penalty,temp,k,p", [(1.0, 1.0, 0, 1.0), (1.3, 0.7, 5, 1.0), (1.0, 1.5, 0, 0.8),
                                              (0.9, 0.5, 20, 0.6)])
def test_process_logits_matches_transformers(penalty, temp, k, p):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((3, 50)) * 3).astype(np.float32)
    hist = [rng.integers(0, 50, n) for n in (4, 9, 1)]
    cfg = SamplingConfig(do_sample=True, temperature=temp, top_k=k, top_p=p, repetition_penalty=penalty)
    ours = process_logits(logits, hist, cfg)
    ids = torch.tensor(np.stack([np.resize(h, 9) for h in hist]))  # pad by repeating: same token sets
    scores = torch.tensor(logits)
    procs = [RepetitionPenaltyLogitsProcessor(penalty)] if penalty != 1.0 else []
    procs += [TemperatureLogitsWarper(temp)] if temp != 1.0 else []
    procs += [TopKLogitsWarper(k)] if k else []
    procs += [TopPLogitsWarper(p)] if p < 1.0 else []
    for proc in procs:
        scores = proc(ids, scores)
    ref = scores.numpy()
    assert np.array_equal(np.isinf(ours), np.isinf(ref))
    finite = ~np.isinf(ref)
    np.testing.assert_allclose(ours[finite], ref[finite], rtol=1e-6, atol=1e-6)


def test_sampling_frequencies_follow_the_filtered_distribution():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    cfg = SamplingConfig(do_sample=True, top_k=2)
    rng = np.random.default_rng(0)
    draws = np.array([choose(logits, [np.array([], np.int64)], cfg, rng)[0] for _ in range(4000)])
    assert set(draws.tolist()) == {0, 1}
    assert abs((draws == 0).mean() - 0.5 / 0.8) < 0.03


def test_invalid_options_are_errors():
    for bad in (dict(temperature=0), dict(top_p=0), dict(top_k=-1), dict(max_new_tokens=0),
                dict(repetition_penalty=0)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad).validate()


def test_sample_scores_draws_what_rng_choice_draws_and_never_a_filtered_token():
    """The block sampler draws numpy's own `Generator.choice(V, p=softmax(row))` draws from the same uniforms
    (one `random()` per row, the generator left in the same state; all but float32-rounding boundary cases),
    follows the distribution, and never picks an -inf token."""
    from mindvl_ms.infer.sampling import _softmax, sample_scores

    g = np.random.default_rng(1)
    agree = total = 0
    for t in range(200):
        v, b = int(g.integers(2, 5000)), int(g.integers(1, 9))
        x = (g.normal(size=(b, v)) * g.uniform(0.1, 20)).astype(np.float32)
        if t % 3 == 0:  # filtered logits (top-k / top-p) leave -inf entries
            x[:, g.integers(0, v, size=v // 2)] = -np.inf
        seed = int(g.integers(0, 2**31))
        r1, r2 = np.random.default_rng(seed), np.random.default_rng(seed)
        want = np.array([r1.choice(v, p=row) for row in _softmax(x)])
        ours = sample_scores(x, r2.random(b), block=int(g.integers(1, 700)))
        assert r1.random() == r2.random()
        assert np.isfinite(x[np.arange(b), ours]).all()
        agree += int((ours == want).sum())
        total += b
    assert agree >= total - 2, (agree, total)
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05, 0.0]], np.float32))
    rng = np.random.default_rng(0)
    draws = np.concatenate([sample_scores(np.repeat(logits, 100, 0), rng.random(100), block=2)
                            for _ in range(100)])
    freq = np.bincount(draws, minlength=5) / draws.size
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05, 0.0], atol=0.012)
