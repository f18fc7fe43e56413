"""Worker for tests/train/test_variants.py: resumes the variant run from OUT_DIR's latest checkpoint (the
test copies there the uninterrupted run's directory as it was when multitask ended) and is killed with
SIGKILL when the named variant is about to start (the previous variant's end is saved).

    python tests/workers/train_variants_kill.py DATA.jsonl OUT_DIR VARIANT
"""
import sys

import mindspore as ms

from mindvl_ms.ops.process import freeze_imported_objects
from mindvl_ms.train import run_training
from tests.train.test_variants import Recorder, run_cfg, tiny_model

if __name__ == "__main__":
    freeze_imported_objects()  # one model per process: MindSpore's gc.collect() before each compile skips them
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    data, out, stop_at = sys.argv[1:4]
    cfg = run_cfg(data)
    model = tiny_model(cfg)
    run_training(cfg, out, resume=out, model=model, data_factory=Recorder(model, stop_at=stop_at), progress=False)
