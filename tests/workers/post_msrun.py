"""Worker for tests/train/post/test_post_msrun.py: a GRPO stage on the tiny MindVL (each rank samples the rollouts
of its own prompts with the engine sampler), saving the final parameters. Run under msrun (2 ranks) or as one
process.

    python tests/workers/post_msrun.py OUT_DIR
"""
import os
import sys

import numpy as np

from mindvl_ms.ops.process import freeze_imported_objects
from tests.support import msrun
from tests.support import post as H

# seq_length 16: one prompt (9 tokens) + response (4) per row, so rows are the same in both runs; the objective
# constants of tests/train/post/test_grpo_train.py (kl_coef 0.01): in one process with that module the reference
# run reuses the post step compiled there (tests/support/post.py fresh_model)
STAGE = {"name": "grpo", "type": "grpo", "seq_length": 16, "global_batch_size": 2, "micro_batch_size": 1,
         "max_lr": 1e-2, "warmup_ratio": 0.0, "epochs": None, "max_steps": 2, "weight_decay": 0.0,
         "grpo": {"group_size": 4, "mini_batch_size": 4, "max_new_tokens": 4, "reward": "tests.support.post:low_ids",
                  "kl_coef": 0.01}}


def main(out: str, model=None) -> None:
    """The stage on `model` (at the seed-0 initial weights; None: a new one)."""
    model, summary, recs = H.run(out, dict(STAGE), lambda *a: H.prompt_source(), plot=False, model=model)
    rank = int(os.environ.get("RANK_ID", "0"))
    np.savez(os.path.join(out, f"params_rank{rank}.npz"), **{p.name: p.asnumpy() for p in model.get_parameters()})
    print("RANKS", summary["ranks"], "REWARDS", [r["reward_mean"] for r in recs], flush=True)


if __name__ == "__main__":
    msrun.schedule_only()  # msrun's scheduler runs this script too: it only schedules (no model of its own)
    freeze_imported_objects()  # the gc.collect() before each graph compile skips the imports (ops/process.py)
    main(sys.argv[1])
