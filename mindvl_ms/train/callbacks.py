"""What a user sees while training: progress bar, metrics JSONL, loss/LR plot, run summary with MFU.

- `ProgressBar`: tqdm over the stage's steps with step, loss, tokens/s, LR (ETA from tqdm).
- `MetricsLog`: one JSON object per logged step in OUT/metrics.jsonl (stage, step, loss, lr,
  grad_norm, loss_scale, applied, tokens, tokens_per_s, step_time). On resume the file is cut back
  to the checkpoint's position, so an interrupted + resumed run logs exactly the lines of an
  uninterrupted one. With `report_to: [tensorboard]` the same records and the run summary also go to
  OUT/tensorboard/ through `TensorBoardLog`.
- `TensorBoardLog`: TensorBoard event files (tensorboardX) for the step records and the run summary.
- `plot_stage`: OUT/<stage>/loss_lr.png (matplotlib Agg; loss left axis, LR right axis).
- `summarize`: throughput and model FLOPs utilisation. FLOPs per step = 6 x parameters x tokens
  (forward 2 + backward 4, the PaLM convention; attention score FLOPs left out), counted for the LLM
  on text tokens and for the vision tower on patches. MFU divides by the per-device peak from
  `device_peak`: the vendor's dense matmul peak for the device and compute dtype when `PEAK_TFLOPS`
  has it (Ascend 910 fp16, Ascend 910B bf16/fp16), else the fp32 matmul rate measured on this machine
  with MindSpore (`measure_matmul_peak`; every CPU run, and Ascend with float32 or an unlisted chip).
  The summary and the log say which (`peak_source`, "table: ..." or "measured: ...").
"""
from __future__ import annotations

import itertools
import json
import numbers
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mindspore as ms
import numpy as np
from matplotlib.figure import Figure
from mindspore import Tensor, ops
from mindspore._c_expression import MSContext
from tqdm import tqdm


class ProgressBar:
    def __init__(self, total: int, initial: int, desc: str, enabled: bool = True):
        self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", disable=not enabled,
                        dynamic_ncols=True)

    def update(self, rec: Dict[str, Any]) -> None:
        post = {k: f"{rec[k]:.3f}" for k in ("reward_mean", "clip_frac", "margin", "pref_accuracy") if k in rec}
        self.bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}", lr=f"{rec['lr']:.2e}",
                             **post, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


_EVENT_FILES = itertools.count()  # event files opened by this process (TensorBoardLog file names)


class TensorBoardLog:
    """Step records and the run summary as TensorBoard scalars in one directory (tensorboardX).

    Tags are the records' numeric fields under their metrics.jsonl names (loss, lr, grad_norm,
    tokens_per_s, step_time, ...; DPO's margin and pref_accuracy, GRPO's reward_mean, ...), and
    `stage_index`, which shows where each stage begins. The step is the optimizer step counted over the
    whole run: stage k's step s is s plus the steps of stages 0..k-1 (one past the last step each of them
    logged; a stage always logs its last step), so the curves of a chain continue across stages. The run
    summary's figures (mfu, tokens_per_s, model_tflops_per_s, ...) are tagged summary/<name> at the last
    step. The step records' purge point mirrors metrics.jsonl: the first event file of a fresh run
    starts with a TensorBoard restart marker (SessionLog START) at step 0, hiding an earlier run's events
    in the directory, a resumed run's at the step after its checkpoint, hiding what the interrupted run
    logged past it. Training runs no evaluation: held-out scores are in `mindvl eval`'s scores.json and
    the demo's report.json.

    One writer at a time: it opens on the first value, `close()` flushes and closes it (the trainer calls
    it at every stage end, also when the stage fails), and the next value opens a new event file. File
    names end in .<pid>.<n>, n counting the files the process opened (every log's), so two files opened in
    the same second (tensorboardX names them by the second) do not overwrite each other, also when a
    stopped run and its resume run in one process.

    tensorboardX is imported when the first file opens, not with this module: its package imports torch
    when torch is installed (as in the test environment), which costs every training process seconds and
    ~180 MB of resident memory (docs/PERFORMANCE.md, "## train") whether or not it reports to TensorBoard."""

    def __init__(self, logdir: str):
        self.logdir = logdir
        self.writer: Any = None  # a tensorboardX SummaryWriter while a file is open
        self.purge_step: Optional[int] = 0  # cleared once the first file carries it
        self.last_step: Dict[int, int] = {}  # stage index -> its last logged step
        self.global_step = -1

    def _open(self):
        if self.writer is None:
            from tensorboardX import SummaryWriter  # on first use: see the class docstring
            self.writer = SummaryWriter(self.logdir, purge_step=self.purge_step,
                                        filename_suffix=f".{os.getpid()}.{next(_EVENT_FILES):03d}")
            self.purge_step = None
        return self.writer

    def _advance(self, rec: Dict[str, Any]) -> int:
        """The record's step counted over the run (see the class docstring)."""
        si = rec["stage_index"]
        self.last_step[si] = rec["step"]
        self.global_step = sum(s + 1 for i, s in self.last_step.items() if i < si) + rec["step"]
        return self.global_step

    def resume_after(self, kept: List[Dict[str, Any]]) -> None:
        """Continue after the records metrics.jsonl kept on resume: their steps count, and the next event
        file hides every step past the last of them."""
        for rec in kept:
            self._advance(rec)
        self.purge_step = self.global_step + 1

    def write(self, rec: Dict[str, Any]) -> None:
        step, writer = self._advance(rec), self._open()
        for key, value in rec.items():
            if key != "step" and isinstance(value, numbers.Real) and not isinstance(value, bool):
                writer.add_scalar(key, float(value), step)

    def write_summary(self, summary: Dict[str, Any]) -> None:
        """The summary's numeric figures as summary/<name> at the run's last step, then closed."""
        writer = self._open()
        try:
            for key, value in summary.items():
                if isinstance(value, numbers.Real) and not isinstance(value, bool):
                    writer.add_scalar(f"summary/{key}", float(value), max(self.global_step, 0))
        finally:
            self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()  # flushes
            self.writer = None


class MetricsLog:
    """Append-only JSONL of step records (rank 0 writes), and the `report_to` targets beside it
    (tensorboard: `TensorBoardLog` in tensorboard/ next to the JSONL)."""

    def __init__(self, path: str, enabled: bool = True, report_to: Sequence[str] = ()):
        self.path, self.enabled = path, enabled
        tb_dir = os.path.join(os.path.dirname(path), "tensorboard")
        self.tensorboard = TensorBoardLog(tb_dir) if enabled and "tensorboard" in report_to else None

    def truncate_after(self, stage_index: int, step: int) -> None:
        """Drop records past (stage_index, step): what an interrupted run logged after its checkpoint."""
        if not (self.enabled and os.path.isfile(self.path)):
            return
        keep = [line for line in open(self.path, encoding="utf-8")
                if line.strip() and (json.loads(line)["stage_index"], json.loads(line)["step"]) <= (stage_index, step)]
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(keep)
        os.replace(tmp, self.path)
        if self.tensorboard is not None:
            self.tensorboard.resume_after([json.loads(line) for line in keep])

    def write(self, rec: Dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.write(rec)

    def write_summary(self, summary: Dict[str, Any]) -> None:
        """The run summary to the `report_to` targets (summary.json is the trainer's)."""
        if self.tensorboard is not None:
            self.tensorboard.write_summary(summary)

    def close(self) -> None:
        """Flush and close the `report_to` writers (stage end); a later record opens new ones."""
        if self.tensorboard is not None:
            self.tensorboard.close()

    def read(self, stage: Optional[str] = None) -> List[Dict[str, Any]]:
        if not os.path.isfile(self.path):
            return []
        recs = [json.loads(line) for line in open(self.path, encoding="utf-8") if line.strip()]
        return [r for r in recs if stage is None or r["stage"] == stage]


def plot_stage(records: List[Dict[str, Any]], path: str, title: str) -> Optional[str]:
    """Loss and LR against step; returns the PNG path (None without records)."""
    if not records:
        return None
    steps = [r["step"] for r in records]
    fig = Figure(figsize=(7, 4), dpi=100)  # no pyplot: no global backend, nothing to close
    ax = fig.subplots()
    ax.plot(steps, [r["loss"] for r in records], color="tab:blue", label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(steps, [r["lr"] for r in records], color="tab:orange", label="lr")
    ax2.set_ylabel("learning rate", color="tab:orange")
    ax.set_title(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path)
    return path


def measure_matmul_peak(n: int = 512, repeats: int = 20) -> float:
    """Achieved fp32 FLOP/s of an n x n MindSpore matmul on this device (best of `repeats`)."""
    a = Tensor(np.random.RandomState(0).rand(n, n).astype(np.float32))
    b = Tensor(np.random.RandomState(1).rand(n, n).astype(np.float32))
    ops.matmul(a, b).asnumpy()  # warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        ops.matmul(a, b).asnumpy()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best


# (SoC version as MindSpore names it, compute dtype) -> (dense matmul peak per device in TFLOP/s, source).
# SoC names: MSContext.get_ascend_soc_version() ('ascend910' = 910A, 'ascend910b' = the 910B family).
PEAK_TFLOPS: Dict[Tuple[str, str], Tuple[float, str]] = {
    ("ascend910", "float16"): (256.0, "Ascend 910 fp16 peak published by Huawei (2019): 256 TFLOPS"),
    ("ascend910b", "bfloat16"): (313.0, "Ascend 910B (Atlas 800T A2) bf16/fp16 peak as commonly quoted: 313 TFLOPS"),
    ("ascend910b", "float16"): (313.0, "Ascend 910B (Atlas 800T A2) bf16/fp16 peak as commonly quoted: 313 TFLOPS"),
}


def soc_version() -> str:
    """MindSpore's Ascend SoC name ('' off Ascend or when MindSpore cannot tell)."""
    try:
        if ms.get_context("device_target") != "Ascend":
            return ""
        return str(MSContext.get_instance().get_ascend_soc_version() or "")
    except (AttributeError, RuntimeError):
        return ""


def device_peak(device_target: str, soc: str, precision: str,
                measure: Callable[[], float] = measure_matmul_peak) -> Tuple[float, str]:
    """(peak FLOP/s per device, where it comes from) for MFU; see the module docstring."""
    hit = PEAK_TFLOPS.get((soc.lower(), precision)) if device_target == "Ascend" else None
    if hit is not None:
        return hit[0] * 1e12, f"table: {hit[1]} ({soc}, {precision})"
    flops = measure()
    why = f"no table entry for {soc or device_target} {precision}; " if device_target == "Ascend" else ""
    return flops, f"measured: {why}fp32 512x512 MindSpore matmul on this {device_target}, {flops / 1e9:.1f} GFLOP/s"


def param_counts(model) -> Dict[str, int]:
    """Parameters of the vision tower, the LLM (without the embedding lookup table) and in total."""
    vis = llm = total = 0
    tied = getattr(getattr(model, "config", None), "text", None)
    tied = bool(getattr(tied, "tie_word_embeddings", False))
    for p in model.get_parameters():
        n = int(np.prod(p.shape))
        total += n
        if p.name.startswith("visual."):
            vis += n
        elif "embed_tokens" not in p.name or tied:  # a tied table is also the lm_head matmul
            llm += n
    return {"vision": vis, "llm": llm, "total": total}


def summarize(records: List[Dict[str, Any]], counts: Dict[str, int], peak_flops: float, world: int,
              wall_time: float, compile_time: float, peak_source: str = "measured") -> Dict[str, Any]:
    """Run summary from step records (this rank's tokens; FLOPs scaled by the number of ranks)."""
    if not records:
        return {"steps": 0, "wall_time_s": wall_time}
    step_time = sum(r["step_time"] for r in records)
    tokens = sum(r["tokens"] for r in records) * world
    patches = sum(r.get("patches", 0) for r in records) * world
    flops = 6.0 * (counts["llm"] * tokens + counts["vision"] * patches)
    achieved = flops / max(step_time, 1e-9)
    return {
        "steps": len(records),
        "tokens": tokens,
        "tokens_per_s": tokens / max(step_time, 1e-9),
        "mean_step_time_s": step_time / len(records),
        "model_tflops_per_s": achieved / 1e12,
        "peak_tflops_per_s": peak_flops * world / 1e12,
        "mfu": achieved / (peak_flops * world),
        "peak_source": peak_source,
        "final_loss": records[-1]["loss"],
        "skipped_steps": sum(0 if r["applied"] else 1 for r in records),
        "compile_time_s": compile_time,
        "wall_time_s": wall_time,
        "params": counts,
    }
