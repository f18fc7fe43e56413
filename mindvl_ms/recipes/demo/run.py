"""The `mindvl demo` pipeline: data -> warm-up -> multitask -> SFT x 2 sequence lengths -> merge -> eval.

    from mindvl_ms.recipes.demo.run import run_demo
    report = run_demo("runs/demo", quick=False)      # what `mindvl demo` does

Design:
- One YAML (configs/demo/full.yaml, or quick.yaml for `--quick`) is a normal training run config
  (`mindvl_ms.config.train.RunConfig`) plus a `demo:` section (data sizes, model YAML, evaluation
  settings) that this module pops before loading the rest; a top-level `model:` section overrides
  fields of the model YAML (deep merge).
- Each phase (pre-SFT stages, each SFT variant, evaluation) runs in its own spawned process
  (`in_child`): MindSpore keeps a process's memory pool and graphs, and the phases together would
  not fit in memory next to each other.
- Stages whose names do not start with `sft` run chained in one `run_training` call (warm-up
  trains the projector only, multitask trains everything). Every `sft*` stage is a variant: each
  starts from the last pre-SFT checkpoint in its own run, so the variants (two sequence lengths)
  can be averaged by `checkpoint.merge.merge` like MindVL's 2K/4K/8K SFT merge.
- Data comes from `demo.datasets` (JSONL + images). Rows for a stage are built here (`DemoRows`):
  samples are parsed once and measured from metadata, mix weights repeat/subsample a source
  deterministically, and `data.packing.pack_bfd` packs them into rows of the stage's sequence
  length; the trainer gets them as an in-memory `RowSource`, and images are decoded per batch.
- Training uses the plain MindVL model; the train step runs the LM head only at supervised positions,
  in chunks (`train.loss_head`: the head over the 151,936-token vocabulary is almost all of the tiny
  model's compute).
- Evaluation runs `eval.benchmark.evaluate` (batched greedy generation through
  `mindvl_ms.infer.generate`) on each task's held-out split for the two SFT variants and the merged
  checkpoint, and `eval.resolution_search.search` on the OCR split of the merged checkpoint.
- Everything lands in OUT: data/, train/ (pre-SFT stages), sft_<name>/, merged/, eval/,
  resolution_search/ and report.json (the printed summary, machine readable).
"""
from __future__ import annotations

import copy
import json
import logging
import os
import time
from typing import Any, Dict, List, Optional

import numpy as np

log = logging.getLogger(__name__)


def demo_config_dir() -> str:
    """configs/demo of the packaged configs (an installed wheel or the source checkout)."""
    from mindvl_ms.config.packaged import configs_dir

    return os.path.join(configs_dir(), "demo")


def config_path(quick: bool) -> str:
    from mindvl_ms.config.packaged import packaged_path

    return packaged_path("demo/quick.yaml" if quick else "demo/full.yaml")


DEMO_KEYS = ("model", "vocab", "data_sizes", "vqa_mix", "vqa_balance_yes_no", "vqa_question_first", "vqa_describe",
             "eval_batch_size", "eval_variants", "max_new_tokens", "resolution_grid")  # the `demo:` section's settings
DEMO_BOOL_KEYS = ("vqa_balance_yes_no", "vqa_question_first", "vqa_describe", "eval_variants")  # YAML true/false


def load_demo_config(path: str, data_dir: str, overrides: Optional[List[str]] = None, vocab_subset: bool = True):
    """(RunConfig, demo section) from a demo YAML; data sources are resolved against data_dir. With
    `demo.vocab: data` and vocab_subset, the subset an earlier run wrote in data_dir/tokenizer is applied."""
    from mindvl_ms.config.base import ConfigError, deep_merge, read_yaml
    from mindvl_ms.config.train import load_run_config
    from mindvl_ms.data.vocab_subset import SUBSET_FILE

    raw = read_yaml(path)
    demo = raw.pop("demo", None)
    if not isinstance(demo, dict):
        raise ConfigError(f"{path}: missing the `demo:` section (model, data_sizes, eval settings)")
    unknown = sorted(set(demo) - set(DEMO_KEYS))
    if unknown:
        raise ConfigError(f"{path}: demo.{unknown[0]} is not a demo setting; expected one of {', '.join(DEMO_KEYS)}")
    for key in DEMO_BOOL_KEYS:
        if key in demo and not isinstance(demo[key], bool):
            raise ConfigError(f"{path}: demo.{key} must be true or false, got {demo[key]!r}")
    model_yaml = demo.get("model")
    if model_yaml:  # a `model:` section in the demo YAML overrides fields of demo.model
        # relative to the given YAML, else to configs/demo/ (a YAML that `_include_`s full.yaml from elsewhere)
        tried = [os.path.join(d, model_yaml) for d in (os.path.dirname(os.path.abspath(path)), demo_config_dir())]
        found = [t for t in tried if os.path.isfile(t)]
        if not found:
            raise ConfigError(f"{path}: demo.model {model_yaml!r} not found (looked for {' and '.join(tried)})")
        raw["model"] = deep_merge(read_yaml(found[0]), raw.get("model") or {})

    def resolve(d: Dict[str, Any]) -> None:
        for s in d.get("sources", []) or []:
            if "path" in s and not os.path.isabs(s["path"]):
                s["path"] = os.path.join(data_dir, s["path"])

    resolve(raw.get("data", {}))
    for st in raw.get("stages", []):
        resolve(st.get("data", {}))
    subset = os.path.join(data_dir, "tokenizer")
    if vocab_subset and demo.get("vocab", "full") == "data" and os.path.isfile(os.path.join(subset, SUBSET_FILE)):
        raw.setdefault("data", {})["tokenizer"] = subset  # an earlier `restrict_vocab`'s; the model follows it
    return load_run_config(data=raw, overrides=overrides), demo


# ------------------------------------------------------------------------------------------- data

class DemoRows:
    """`data_factory` for run_training: mix-weighted, packed rows of parsed samples per stage.

    Rows hold parsed samples (`data.schema.Sample`, text and image paths only); lengths for packing
    come from metadata (`data.offline.sample_meta`, no image decoding). The images are decoded and
    patchified when a batch is built (`collate`), so memory stays flat however large the data is.
    """

    def __init__(self, progress: bool = True):
        self.parsed: Dict[str, List[Any]] = {}
        self.proc = None
        self.progress = progress
        self.reports: Dict[str, Dict[str, Any]] = {}

    def processor(self, data_cfg):
        from mindvl_ms.data.processor import MindVLProcessor

        if self.proc is None or self.proc.config.image != data_cfg.image or \
                self.proc.config.system_prompt != data_cfg.system_prompt:
            self.proc, self.parsed = MindVLProcessor(config=data_cfg), {}
        return self.proc

    def samples(self, path: str, data_cfg) -> List[Any]:
        """[(Sample, tokens, image_tokens)] of a JSONL file (parsed once, cached)."""
        from mindvl_ms.data.offline import sample_meta
        from mindvl_ms.data.schema import SampleError, iter_jsonl

        proc = self.processor(data_cfg)
        if path not in self.parsed:
            out = []
            for n, s in iter_jsonl(path):
                try:
                    if isinstance(s, SampleError):
                        raise s
                    out.append((s, *sample_meta(proc, s)))
                except SampleError as e:  # demo data is generated, so a bad line is a bug: stop loudly
                    raise ValueError(str(e)) from None
            self.parsed[path] = out
        return self.parsed[path]

    def collate(self, model_cfg):
        """Trainer collate: process the row's samples, `build_model_inputs` (padded to the longest row);
        the train step compacts the supervised positions itself (`train.loss_head`)."""
        from mindvl_ms.data.collate import build_model_inputs

        def collate(rows, stage):
            done = [[self.proc.process_sample(s) for s in row] for row in rows]
            return build_model_inputs(done, model_cfg)
        return collate

    def __call__(self, run_cfg, stage, stage_index: int, dist):
        from mindvl_ms.config.base import deep_merge, load, to_dict
        from mindvl_ms.config.data import DataConfig
        from mindvl_ms.data.packing import Item, pack_bfd, split_oversized
        from mindvl_ms.train.batches import RowSource

        data_cfg = load(DataConfig, deep_merge(to_dict(run_cfg.data), stage.data), source=f"stage '{stage.name}' data")
        rng = np.random.default_rng([run_cfg.seed, stage_index])
        chosen: List[Any] = []
        for src in data_cfg.sources:
            pool = self.samples(src.path, data_cfg)
            reps = int(np.floor(src.weight))
            idx = np.concatenate([np.arange(len(pool))] * reps + [
                rng.choice(len(pool), size=int(round((src.weight - reps) * len(pool))), replace=False)])
            chosen.extend(pool[int(i)] for i in idx)
        items = [Item(i, tokens, image_tokens) for i, (_, tokens, image_tokens) in enumerate(chosen)]
        budget = min(data_cfg.visual_budget(), stage.seq_length)
        ok, dropped = split_oversized(items, stage.seq_length, budget)
        if dropped:
            log.warning("stage %s: %d sample(s) do not fit a %d-token row and are left out (first: %s)",
                        stage.name, len(dropped), stage.seq_length, dropped[0][1])
        packs = pack_bfd(ok, stage.seq_length, budget)
        rows = [[chosen[it.key][0] for it in p.items] for p in packs]
        fill = sum(p.tokens for p in packs) / max(1, len(packs) * stage.seq_length)
        self.reports[stage.name] = {"samples": len(ok), "dropped": len(dropped), "rows": len(rows),
                                    "fill": round(fill, 3)}
        log.info("stage %s: %d samples packed into %d rows of %d tokens (%.1f%% full)", stage.name, len(ok),
                 len(rows), stage.seq_length, 100 * fill)
        return RowSource(rows, seed=run_cfg.seed + stage_index, shuffle=data_cfg.shuffle)


# ------------------------------------------------------------------------------------------- training

def _stage_loss(summary: Dict[str, Any], metrics_path: str) -> Dict[str, Dict[str, float]]:
    """Per stage: first, last and mean-of-last-10 training loss from the metrics log."""
    recs: Dict[str, List[float]] = {}
    with open(metrics_path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            recs.setdefault(r["stage"], []).append(float(r["loss"]))
    out = {}
    for st in summary["stages"]:
        losses = recs.get(st["stage"], [])
        if losses:
            out[st["stage"]] = {"steps": st["steps"], "first_loss": losses[0], "final_loss": losses[-1],
                                "last10_mean": float(np.mean(losses[-10:])), "checkpoint": st["checkpoint"],
                                "plot": st.get("plot")}
    return out


def train_model(run_cfg, init_from: Optional[str] = None):
    import mindspore as ms

    from mindvl_ms.models.mindvl import MindVLForConditionalGeneration as MindVL

    ms.set_seed(run_cfg.seed)
    return MindVL.from_pretrained(init_from) if init_from else MindVL(run_cfg.model)


def child_setup() -> None:
    """A phase's process (spawned by `in_child`): log like the parent's CLI, graph mode on CPU."""
    import mindspore as ms

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")


def run_stages(run_cfg, out_dir: str, init_from: Optional[str], progress: bool) -> Dict[str, Any]:
    """`run_training` over run_cfg.stages from random init or `init_from`; per-stage losses and packing."""
    from mindvl_ms.train import run_training

    child_setup()
    rows = DemoRows(progress=progress)
    summary = run_training(run_cfg, out_dir, model=train_model(run_cfg, init_from), data_factory=rows,
                           collate=rows.collate(run_cfg.model), progress=progress)
    return {"stages": _stage_loss(summary, os.path.join(out_dir, "metrics.jsonl")),
            "checkpoint": summary["stages"][-1]["checkpoint"], "packing": rows.reports}


def in_child(fn, *args):
    """Run fn(*args) in a fresh (spawned) process and return its result: MindSpore keeps the memory
    pool and compiled graphs of a process alive, so each phase gets its own and frees them on exit.
    The child ends with this process (`die_with_parent`), so a killed demo leaves no training behind."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                             initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
        return pool.submit(fn, *args).result()


def die_with_parent(parent: int) -> None:
    """Child-process initializer: on Linux the kernel sends this process SIGTERM when `parent` ends
    (prctl PR_SET_PDEATHSIG), however it ends (`kill -9` included); a parent already gone ends it now.
    The signal follows the thread that started the child: `in_child` starts it in the calling thread and
    waits there for the result, so that thread outlives the work. Elsewhere the child outlives a killed
    parent, as before."""
    import signal
    import sys

    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def train_all(run_cfg, out_dir: str, progress: bool = True) -> Dict[str, Any]:
    """Pre-SFT stages chained, then each SFT variant from the last pre-SFT checkpoint (one process each)."""
    pre = [s for s in run_cfg.stages if not s.name.startswith("sft")]
    sft = [s for s in run_cfg.stages if s.name.startswith("sft")]
    if not pre or len(sft) < 2:
        raise ValueError("the demo recipe needs pre-SFT stages and at least two `sft*` stages to merge, got "
                         f"{[s.name for s in run_cfg.stages]}")
    cfg = copy.deepcopy(run_cfg)
    cfg.stages = pre
    res = in_child(run_stages, cfg, os.path.join(out_dir, "train"), None, progress)
    stages, packing, base = dict(res["stages"]), dict(res["packing"]), res["checkpoint"]
    sft_ckpts = {}
    for s in sft:
        cfg = copy.deepcopy(run_cfg)
        cfg.stages = [s]
        res = in_child(run_stages, cfg, os.path.join(out_dir, s.name), base, progress)
        stages.update(res["stages"])
        packing.update(res["packing"])
        sft_ckpts[s.name] = res["checkpoint"]
    return {"stages": stages, "packing": packing, "pre_sft_checkpoint": base, "sft_checkpoints": sft_ckpts}


# ------------------------------------------------------------------------------------------- evaluation

_BACKENDS: Dict[str, Any] = {}


def eval_backend(ckpt: str, data_cfg, max_new_tokens: int):
    """The generation backend of `mindvl eval`, with the processor the demo trained with (no system
    turn); one per checkpoint (its compiled graphs serve the evaluation and the resolution search)."""
    from mindvl_ms.data.processor import MindVLProcessor
    from mindvl_ms.infer.generate import EvalBackend, load_model

    key = os.path.abspath(ckpt)
    if key not in _BACKENDS:
        _BACKENDS[key] = EvalBackend(load_model(ckpt), MindVLProcessor(config=data_cfg), max_new_tokens)
    return _BACKENDS[key]


def evaluate_all(ckpts: Dict[str, str], heldout: Dict[str, str], data_cfg, demo: Dict[str, Any],
                 out_dir: str, progress: bool = True) -> Dict[str, Dict[str, float]]:
    """{checkpoint name: {task: primary score}} on every held-out split."""
    from mindvl_ms.eval.benchmark import evaluate

    scores: Dict[str, Dict[str, float]] = {}
    img = data_cfg.image
    for name, ckpt in ckpts.items():
        backend = eval_backend(ckpt, data_cfg, int(demo.get("max_new_tokens", 24)))
        scores[name] = {}
        for task, path in heldout.items():
            res = evaluate(ckpt, path, os.path.join(out_dir, name, task), backend=backend,
                           min_pixels=img.min_pixels, max_pixels=img.max_pixels,
                           batch_size=int(demo.get("eval_batch_size", 16)),
                           max_new_tokens=int(demo.get("max_new_tokens", 24)), progress=progress)
            scores[name][task] = res["tasks"][task]["primary"]
    return scores


def resolution_search(ckpt: str, data: str, data_cfg, demo: Dict[str, Any], out_dir: str,
                      progress: bool = True) -> Dict[str, Any]:
    from mindvl_ms.eval.resolution_search import search

    grid = demo.get("resolution_grid") or {"min": [4, 16], "max": [8, 16, 32]}
    res = search([ckpt], [data], out_dir, backend_factory=lambda c: eval_backend(c, data_cfg, int(
        demo.get("max_new_tokens", 24))), min_grid=grid["min"], max_grid=grid["max"],
        batch_size=int(demo.get("eval_batch_size", 16)), max_new_tokens=int(demo.get("max_new_tokens", 24)),
        progress=progress)
    best = res["best"][ckpt]["average"]
    return {"settings": len(res["rows"]), "best_min_pixels": best["min_pixels"],
            "best_max_pixels": best["max_pixels"], "best_score": best["score"],
            "scores": [(r["min_pixels"], r["max_pixels"], r["average"]) for r in res["rows"]],
            "table": os.path.join(out_dir, "resolution_table.md"), "plot": res.get("plot")}


def evaluate_phase(ckpts: Dict[str, str], heldout: Dict[str, str], data_cfg, demo: Dict[str, Any], out_dir: str,
                   progress: bool = True):
    """Held-out scores of every checkpoint, then the resolution search on the OCR split of `merged`."""
    child_setup()
    scores = evaluate_all(ckpts, heldout, data_cfg, demo, os.path.join(out_dir, "eval"), progress)
    search = resolution_search(ckpts["merged"], heldout["ocr"], data_cfg, demo,
                               os.path.join(out_dir, "resolution_search"), progress)
    return scores, search


# ------------------------------------------------------------------------------------------- the job

def run_demo(out_dir: str = "runs/demo", quick: bool = False, config: Optional[str] = None,
             overrides: Optional[List[str]] = None, progress: bool = True) -> Dict[str, Any]:
    """The whole demo; returns the report (also OUT/report.json) and prints it."""
    import mindspore as ms

    from mindvl_ms.checkpoint.merge import merge
    from mindvl_ms.config.packaged import resolve_config

    t0 = time.perf_counter()
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    path = resolve_config(config)[0] if config else config_path(quick)
    data_dir = os.path.join(out_dir, "data")
    run_cfg, demo = load_demo_config(path, data_dir, overrides, vocab_subset=False)  # restrict_vocab redoes it
    info = write_data(demo, data_dir, run_cfg.seed, progress)
    info["vocab"] = restrict_vocab(run_cfg, demo, data_dir, list(info["files"]["heldout"].values()))
    t_data = time.perf_counter()
    trained = train_all(run_cfg, out_dir, progress=progress)
    t_train = time.perf_counter()
    merged = os.path.join(out_dir, "merged")
    record = merge(list(trained["sft_checkpoints"].values()), merged, method="linear", overwrite=True,
                   progress=progress)
    ckpts = dict(trained["sft_checkpoints"] if demo.get("eval_variants", True) else {}, merged=merged)
    scores, search = in_child(evaluate_phase, ckpts, info["files"]["heldout"], run_cfg.data, demo, out_dir,
                              progress)
    scores_by_type = {n: vqa_scores_by_type(os.path.join(out_dir, "eval", n, "vqa", "predictions.jsonl"))
                      for n in ckpts} if "vqa" in scores.get("merged", {}) else {}
    t_end = time.perf_counter()
    report = {"config": os.path.abspath(path), "out_dir": os.path.abspath(out_dir), "quick": quick,
              "stages": trained["stages"], "packing": trained["packing"], "baselines": info["baselines"], "vocab": info["vocab"],
              "scores": scores, "vqa_by_type": scores_by_type, "merge": {"checkpoint": merged, "inputs": record["inputs"]},
              "resolution_search": search,
              "wall_time_s": {"data": t_data - t0, "train": t_train - t_data, "merge_eval": t_end - t_train,
                              "total": t_end - t0}}
    with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, default=str)
    print(format_report(report))
    return report


def write_data(demo: Dict[str, Any], data_dir: str, seed: int, progress: bool = True) -> Dict[str, Any]:
    """The demo's datasets as the `demo:` section sets them: `data_sizes` {task: [train, held-out]} and
    `vqa_mix` {question type: weight} of the easy-VQA train split (null: the package's own mix), and
    `vqa_balance_yes_no` (its yes/no questions equally over negated/plain wording x yes/no answer) and
    `vqa_question_first` (each easy-VQA question before its image instead of after it), and `vqa_describe`
    (each easy-VQA train answer describes the image first: "a blue rectangle. red: absent. yes")."""
    from mindvl_ms.recipes.demo.datasets import write_demo_data

    sizes = {k: tuple(v) for k, v in (demo.get("data_sizes") or {}).items()}
    return write_demo_data(data_dir, seed=seed, sizes=sizes, progress=progress, vqa_mix=demo.get("vqa_mix"),
                           vqa_balance_yes_no=bool(demo.get("vqa_balance_yes_no", False)),
                           vqa_question_first=bool(demo.get("vqa_question_first", False)),
                           vqa_describe=bool(demo.get("vqa_describe", False)))


def restrict_vocab(run_cfg, demo: Dict[str, Any], data_dir: str, heldout: List[str]) -> Dict[str, Any]:
    """`demo.vocab`: "full" keeps the tokenizer's whole vocabulary; "data" gives the model only the token
    ids the train sources use, plus those of the `heldout` benchmarks' prompts as `mindvl eval` reads them
    (inputs only, never their answers: an input token no train line has gets an untrained row, as it would
    in the full vocabulary); see `data.vocab_subset`. A tokenizer directory OUT/data/tokenizer with
    vocab_subset.json becomes `data.tokenizer`, and the model's vocab size and special ids follow it."""
    from mindvl_ms.data.processor import MindVLProcessor
    from mindvl_ms.data.schema import SampleError, iter_jsonl
    from mindvl_ms.config.train import follow_vocab_subset
    from mindvl_ms.data.vocab_subset import subset_ids, write_subset
    from mindvl_ms.eval.benchmark import load_benchmark

    mode = demo.get("vocab", "full")
    if mode not in ("full", "data"):
        raise ValueError(f"demo.vocab {mode!r}: expected 'full' (the tokenizer's vocabulary) or 'data' (the ids the "
                         f"train sources use)")
    full = run_cfg.model.text.vocab_size
    if mode == "full":
        return {"mode": mode, "size": full}
    proc = MindVLProcessor(config=run_cfg.data)
    paths = [s.path for s in run_cfg.data.sources] + [src["path"] for st in run_cfg.stages
                                                      for src in (st.data or {}).get("sources", [])]

    def read(files):
        out = []
        for p in dict.fromkeys(files):
            for _, s in iter_jsonl(p):
                if isinstance(s, SampleError):  # demo data is generated, so a bad line is a bug: stop loudly
                    raise ValueError(str(s))
                out.append(s)
        return out
    # the held-out prompts as `mindvl eval` feeds them (task/metric are benchmark fields there)
    prompts = [it.messages for p in dict.fromkeys(heldout) for it in load_benchmark(p)]
    run_cfg.data.tokenizer = write_subset(os.path.join(data_dir, "tokenizer"), proc.tokenizer,
                                          subset_ids(proc, read(paths), prompts=prompts))
    follow_vocab_subset(run_cfg)
    log.info("demo.vocab data: the model's vocabulary is the %d token ids the train data uses (of %d)",
             run_cfg.model.text.vocab_size, full)
    return {"mode": mode, "size": run_cfg.model.text.vocab_size, "of": full}


def vqa_scores_by_type(predictions: str) -> Dict[str, float]:
    """Exact match per easy-VQA question type (yes/no, colour, shape) from an eval predictions.jsonl."""
    from mindvl_ms.recipes.demo.datasets import VQA_TYPES, vqa_type

    by: Dict[str, List[float]] = {t: [] for t in VQA_TYPES}
    with open(predictions, encoding="utf-8") as f:
        for line in f:
            p = json.loads(line)
            by[vqa_type(p)].append(float(p["score"]))
    return {t: float(np.mean(v)) if v else float("nan") for t, v in by.items()}


def format_report(r: Dict[str, Any]) -> str:
    tasks = list(r["baselines"])
    names = list(r["scores"])
    lines = ["", "== mindvl demo: per-stage training loss (first -> last, mean of the last 10 steps) =="]
    for name, s in r["stages"].items():
        lines.append(f"  {name:<12} {s['steps']:>5} steps   {s['first_loss']:.3f} -> {s['final_loss']:.3f}   "
                     f"(last-10 mean {s['last10_mean']:.3f})")
    lines.append("== held-out accuracy (%) ==")
    lines.append(f"  {'task':<11}{'metric':<14}{'baseline':>9}  " + "".join(f"{n:>11}" for n in names))
    for t in tasks:
        b = r["baselines"][t]
        metric = "Acc@IoU0.5" if t == "grounding" else "exact match"
        lines.append(f"  {t:<11}{metric:<14}{100 * b['score']:>8.1f}%  "
                     + "".join(f"{100 * r['scores'][n][t]:>10.1f}%" for n in names))
    if "question_prior" in r["baselines"].get("vqa", {}):
        lines.append(f"  vqa image-blind question prior (most frequent answer per question template): "
                     f"{100 * r['baselines']['vqa']['question_prior']:.1f}%")
    by_type = r.get("vqa_by_type") or {}
    for t, b in (r["baselines"].get("vqa", {}).get("by_type", {}) if by_type else {}).items():
        lines.append(f"  {'  ' + t:<11}{'prior, n=' + str(b['n']):<14}{100 * b['question_prior']:>8.1f}%  "
                     + "".join(f"{100 * by_type[n][t]:>10.1f}%" for n in names))
    lines.append("  baselines: " + "; ".join(
        f"{t}: {r['baselines'][t]['kind']} ({'chance level' if t != 'vqa' else 'majority-answer baseline'})"
        for t in tasks))
    s = r["resolution_search"]
    lines.append(f"== resolution search on the OCR split (merged, {s['settings']} settings): best min_pixels="
                 f"{s['best_min_pixels']} max_pixels={s['best_max_pixels']} -> {100 * s['best_score']:.1f}% ==")
    w = r["wall_time_s"]
    lines.append(f"== wall time {w['total'] / 60:.1f} min (data {w['data']:.0f}s, training {w['train']:.0f}s, "
                 f"merge+eval {w['merge_eval']:.0f}s) ==")
    out = r["out_dir"]
    lines.append(f"artefacts in {out}: data/ (JSONL + images), train/ and sft_*/ (checkpoints, metrics.jsonl, "
                 f"loss_lr.png), merged/ (averaged SFT checkpoint), eval/ (predictions, scores), "
                 f"resolution_search/ (table, box plot), report.json")
    return "\n".join(lines)
