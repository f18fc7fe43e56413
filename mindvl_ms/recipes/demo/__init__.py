"""`mindvl demo`: a tiny MindVL trained end to end on CPU (warm-up -> multitask -> SFT at two
sequence lengths -> weight-averaging merge -> held-out evaluation).

Modules: `datasets` (easy-VQA, generated OCR and grounding data as JSONL + images), `run` (the
pipeline), `commands` (the CLI). Run `mindvl demo --help`.
"""
