"""Worker for tests/parallel/test_moe_msrun.py: trains the tiny MindVL-MoE (configs/model/tiny-moe.yaml with a
256-token vocabulary, cut to a 1-block ViT and one dense and one MoE text layer besides its MTP layer: the
graph compile is most of the run, and every rank and the reference compile it) through the project trainer for
a few steps on a mixed image/text set, then saves the final parameters. Run under msrun (2 data-parallel ranks)
or as one process with the same global batch.

    python tests/workers/moe_msrun.py OUT_DIR
"""
import os
import sys

import mindspore as ms
import numpy as np

from mindvl_ms.config import read_yaml
from mindvl_ms.models.mindvl import MindVLModel
from mindvl_ms.ops.process import freeze_imported_objects
from mindvl_ms.train import load_run_config, run_training
from mindvl_ms.train.batches import RowSource
from tests.support import hf_tiny, msrun
from tests.support.paths import ROOT


def make_rows(n_rows, seed=0):
    """Rows of 1-2 samples; every third sample has one small image."""
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(n_rows):
        row = []
        for s in range(1 + r % 2):
            sizes = [(28, 28)] if (r + s) % 3 == 0 else []
            ids, pv, grid = hf_tiny.image_sample(rng, sizes, text_len=4, vocab=200)
            labels = ids.copy()
            labels[: len(ids) // 2] = -100
            row.append({"input_ids": ids, "labels": labels, "pixel_values": pv, "image_grid_thw": grid})
        rows.append(row)
    return rows


def main(out: str) -> None:
    model = read_yaml(os.path.join(ROOT, "configs", "model", "tiny-moe.yaml"))
    model["text"].update(vocab_size=hf_tiny.VOCAB, num_hidden_layers=2)  # 1 dense + 1 MoE layer (and the MTP one)
    model["vision"].update(depth=1, fullatt_block_indexes=[0])
    model.update(image_token_id=hf_tiny.IMAGE, video_token_id=253, vision_start_token_id=hf_tiny.VSTART,
                 vision_end_token_id=hf_tiny.VEND)
    cfg = load_run_config(data={"seed": 5, "plot": False, "model": model, "stages": [
        {"name": "dp", "trainable": "all", "seq_length": 40, "global_batch_size": 4, "micro_batch_size": 2,
         "max_lr": 3e-3, "warmup_ratio": 0.0, "epochs": None, "max_steps": 2}]})
    ms.set_seed(0)
    model = MindVLModel(cfg.model)
    np.savez(os.path.join(out + "_init.npz"), **{p.name: p.asnumpy() for p in model.get_parameters()})
    summary = run_training(cfg, out, model=model, progress=False,
                           data_factory=lambda rc, st, i, d: RowSource(make_rows(8), seed=rc.seed))
    rank = int(os.environ.get("RANK_ID", "0"))
    np.savez(os.path.join(out, f"params_rank{rank}.npz"), **{p.name: p.asnumpy() for p in model.get_parameters()})
    print("RANKS", summary["ranks"], "LOSS", summary["final_loss"], flush=True)


if __name__ == "__main__":
    msrun.schedule_only()  # msrun's scheduler runs this script too: it only schedules
    freeze_imported_objects()  # the gc.collect() before each graph compile skips the imports (ops/process.py)
    main(sys.argv[1])
