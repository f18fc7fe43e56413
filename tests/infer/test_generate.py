"""KV-cache generation against transformers' `generate` and the no-cache forward (tiny random Qwen2.5-VL).

One converted checkpoint; the vision / prefill / decode cells compile once for every prompt length,
image count and batch size below (asserted). Run: pytest tests/infer/test_generate.py
"""
import numpy as np
import pytest
import torch

from tests.support import hf_tiny as hf_tiny
from tests.support import infer_tiny as infer_tiny
from mindvl_ms.infer.generate import generate, get_engine
from mindvl_ms.data.collate import build_model_inputs, model_args

N_NEW = 6


@pytest.fixture(scope="module")
def setup():
    return infer_tiny.setup()[1:]


def _hf_generate(hf, s, **kw):
    args = {"input_ids": torch.tensor(s["input_ids"][None])}
    if s["pixel_values"] is not None:
        args.update(pixel_values=torch.tensor(s["pixel_values"]), image_grid_thw=torch.tensor(s["image_grid_thw"]))
    with torch.no_grad():
        out = hf.generate(**args, max_new_tokens=N_NEW, do_sample=False, **kw)
    return out[0, len(s["input_ids"]):].tolist()


def test_greedy_equals_transformers_batched_and_one_by_one(setup):
    hf, model, samples = setup
    ref = [_hf_generate(hf, s) for s in samples]
    assert len({len(s["input_ids"]) for s in samples}) == 3
    left = generate(model, samples, N_NEW)
    right = generate(model, samples, N_NEW, padding_side="right")
    single = [generate(model, [s], N_NEW)[0] for s in samples]
    assert left == ref
    assert right == ref
    assert single == ref
    backend = get_engine(model).backend
    for cell in (backend.vis_f, backend.prefill_cell, backend.decode_cell):
        assert len(cell.compile_cache) == 1  # one graph for every length, image count and batch size


def test_cached_equals_no_cache_forward(setup):
    _, model, samples = setup
    s = samples[2]
    ids = list(s["input_ids"])
    for _ in range(N_NEW):  # greedy continuation by full forwards of the training graph, no cache
        batch = build_model_inputs([[dict(s, input_ids=np.array(ids))]], model.config)
        logits = model(*model_args(batch))[0].asnumpy()
        ids.append(int(logits[0, -1].argmax()))
    assert len(model.compile_cache) == 1  # the training graph compiled once for all lengths
    assert all(t < hf_tiny.IMAGE for t in ids[len(s["input_ids"]):])  # no vision ids emitted (builder applies)
    assert generate(model, [s], N_NEW)[0] == ids[len(s["input_ids"]):]
    assert generate(model, [s], N_NEW, use_cache=False)[0] == ids[len(s["input_ids"]):]


def test_repetition_penalty_equals_transformers(setup):
    hf, model, samples = setup
    ref = [_hf_generate(hf, s, repetition_penalty=1.8) for s in samples[:2]]
    assert generate(model, samples[:2], N_NEW, repetition_penalty=1.8) == ref
    assert ref != [_hf_generate(hf, s) for s in samples[:2]]  # the penalty changed the answer


def test_sampling_reduces_to_greedy_and_is_seeded(setup):
    _, model, samples = setup
    greedy = generate(model, samples, N_NEW)
    assert generate(model, samples, N_NEW, do_sample=True, top_k=1, seed=5) == greedy
    assert generate(model, samples, N_NEW, do_sample=True, top_p=1e-6, seed=5) == greedy
    a = generate(model, samples, N_NEW, do_sample=True, temperature=5.0, seed=11)
    assert a == generate(model, samples, N_NEW, do_sample=True, temperature=5.0, seed=11)
    assert a != greedy  # high-temperature sampling over 256 tokens departs from greedy


def test_stop_token_stop_string_and_max_new_tokens(setup):
    _, model, samples = setup
    greedy = generate(model, samples[1:2], N_NEW)[0]
    eos = greedy[2]
    first = greedy.index(eos)
    assert generate(model, samples[1:2], N_NEW, eos_token_ids=[eos])[0] == greedy[:first + 1]
    decode = lambda ids: " ".join(f"<{i}>" for i in ids)  # noqa: E731
    stop = f"<{greedy[1]}>"
    out = generate(model, samples[1:2], N_NEW, stop_strings=[stop], decode=decode)[0]
    assert out == greedy[:greedy.index(greedy[1]) + 1]
    assert generate(model, samples[1:2], 2)[0] == greedy[:2]
    with pytest.raises(ValueError, match="decode="):
        generate(model, samples[1:2], 2, stop_strings=["x"])


def test_vision_features_computed_once_across_turns(setup):
    _, model, samples = setup
    engine = get_engine(model)
    s = dict(samples[1], pixel_values=samples[1]["pixel_values"] + 0.25)  # an image not seen before
    before = dict(engine.stats)
    turn1 = generate(model, [s], 3)[0]
    answer = [t for t in turn1 if t < hf_tiny.IMAGE]  # the random model may emit vision special ids
    follow_up = np.concatenate([s["input_ids"], answer, [7, 8, 9]])  # next turn re-sends the same image
    turn2 = generate(model, [dict(s, input_ids=follow_up)], 3)[0]
    assert engine.stats["images_encoded"] - before["images_encoded"] == 1
    assert engine.stats["images_reused"] - before["images_reused"] == 1
    assert turn2 == generate(model, [dict(s, input_ids=follow_up)], 3, use_cache=False)[0]


def test_prompt_too_long_and_bad_ids_are_errors(setup):
    _, model, _ = setup
    ctx = model.config.text.max_position_embeddings
    with pytest.raises(ValueError, match="exceeds the model's context"):
        generate(model, [{"input_ids": np.ones(ctx - 2, np.int64)}], 5)
    with pytest.raises(ValueError, match="outside the model vocabulary"):
        generate(model, [{"input_ids": np.array([1, 2, 100000])}], 2)


def test_backend_warns_in_pynative_mode(setup, caplog):
    """Generation outside graph mode runs op by op (far slower): the backend says so when it is built."""
    import mindspore as ms

    from mindvl_ms.infer.generate import EagerBackend

    _, model, _ = setup
    caplog.set_level("WARNING", logger="mindvl_ms.infer.generate")
    EagerBackend(model)
    assert not [r for r in caplog.records if "PyNative" in r.getMessage()]
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        EagerBackend(model)
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)
    assert [r for r in caplog.records if "PyNative mode: generation runs op by op" in r.getMessage()]
