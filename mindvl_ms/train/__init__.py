"""Three-stage training: LR schedule, balanced loss, AdamW, compiled train step, stage runner.

`run_training(run_config, out_dir, resume=None)` is the entry point; `mindvl train` wraps it.
Names are imported lazily so that `mindvl --help` does not load MindSpore.
"""
from mindvl_ms.config.train import RunConfig, StageConfig, load_run_config

__all__ = ["RunConfig", "StageConfig", "load_run_config", "WarmupCosine", "TrainingStopped", "run_training"]


def __getattr__(name):
    if name == "WarmupCosine":
        from mindvl_ms.train.lr import WarmupCosine

        return WarmupCosine
    if name in ("TrainingStopped", "run_training"):
        from mindvl_ms.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'mindvl_ms.train' has no attribute '{name}'")
