"""Inference for MindVL: KV-cache generation, uint8-in-graph preprocessing, MindIR export and runners.

    hf_api.py        `MindVLForConditionalGeneration`: the model with from_pretrained / save_pretrained,
                     `model(**inputs)` and `model.generate(**inputs)` (the public, Hugging Face style class)
    kv_cache.py      graph cells (vision encoder, prefill, decode) over a static KV cache, sharing the model's
                     own sub-cells and parameters; one compile each for every shape
    engine.py        the host-side loop (positions, padding, cache slots, image-feature cache) over any backend
    sampling.py      greedy / temperature / top-k / top-p / repetition penalty, stop conditions
    generate.py      `generate(model, samples, max_new_tokens, ...)`, `generate_text(model, processor, ...)`,
                     `load_model(ckpt)`, `load_eval_backend(ckpt)` for `mindvl eval`
    preprocess.py    uint8 patches on the host, rescale + normalise + temporal patching inside the graph
    export.py        `mindvl export`: vision / prefill / decode MindIR graphs + export.json
    mindir_runner.py the exported graphs end to end (MindSpore Lite when importable, else GraphCell)

The commands (`mindvl generate`, `chat`, `export`) are mindvl_ms/cli/infer.py.
Tests: pytest tests/infer/; benchmark: python bench/bench_infer.py
"""
