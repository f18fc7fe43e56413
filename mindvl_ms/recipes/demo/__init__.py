"""`mindvl demo`: a tiny MindVL trained end to end on CPU (warm-up -> multitask -> SFT at two
sequence lengths -> weight-averaging merge -> held-out evaluation), and `mindvl demo --post-train`.

Modules: `run` (the pipeline; its docstring names the module of each step), `datasets` (the data writer
over `vqa_data`, `ocr_data`, `grounding_data`, `lines` and `baselines`), `post` and `post_phases`
(post-training). The command line is `mindvl_ms/cli/demo.py`; run `mindvl demo --help`.
"""
