"""Three-stage training: LR schedule, balanced loss, AdamW, compiled train step, stage runner.

`run_training(run_config, out_dir, resume=None)` is the entry point; `mindvl train` wraps it.
"""
from mindvl_ms.config.train import RunConfig, StageConfig, load_run_config
from mindvl_ms.train.lr import WarmupCosine
from mindvl_ms.train.trainer import Trainer, TrainingStopped, run_training

__all__ = ["RunConfig", "StageConfig", "load_run_config", "WarmupCosine", "Trainer", "TrainingStopped",
           "run_training"]
