"""Inference for MindVL: KV-cache generation, uint8-in-graph preprocessing, MindIR export and runners.

    kv_cache.py    graph cells (vision encoder, prefill, decode) over a static KV cache, sharing the model's
                   own sub-cells and parameters; one compile each for every shape
    engine.py      the host-side loop (positions, padding, cache slots, image-feature cache) over any backend
    sampling.py    greedy / temperature / top-k / top-p / repetition penalty, stop conditions
    generate.py    `generate(model, samples, max_new_tokens, ...)`, `generate_text(model, processor, ...)`,
                   `load_eval_backend(ckpt)` for `mindvl eval`
    preprocess.py  uint8 patches on the host, rescale + normalise + temporal patching inside the graph
    export.py      `mindvl export`: vision / prefill / decode MindIR graphs + export.json
    runner.py      the exported graphs end to end (MindSpore Lite when importable, else GraphCell)
    commands.py    `mindvl generate`, `mindvl chat`, `mindvl export`

Tests: pytest tests/test_infer_*.py; benchmark: python bench/bench_infer.py
"""
