"""Shared helpers of the research/ experiments: run the project's commands, cache runs, record results.

Every experiment's `run.py` calls the project's own entry points (`mindvl demo`, `mindvl data pack`,
`mindvl train`, or the Python APIs behind them) and writes small result files next to itself:
results.json (numbers, seeds, commit, wall time), results.md (the table, headed by the commit it was made
at) and a PNG plot.

Design choices:
- Bulky outputs (data, checkpoints, predictions) go under $RESEARCH_OUT (default /tmp/mindvl_research),
  never into git.
- A cached run is keyed by the code and the config, not by its name or command alone: `run_key` hashes
  the command, every config file it reads (resolved, includes and all) and `source_hash()`, a hash of the
  sources of mindvl_ms/, configs/ and scripts/. A changed code or config therefore never reuses an old
  result; the run lands in OUT/runs/<key>, so a run two experiments share (the base of seed S, an arm
  that is the same config in two experiments) is trained once.
- The base: `base()` is the demo as shipped, `mindvl demo --set seed=0` (configs/demo/full.yaml: warm-up,
  2,000 multitask steps, the SFT variants, their merge and evaluation), trained once per code and config.
  Every arm starts from its multitask checkpoint (`branch`: the recipe's SFT stage alone, `init_from` that
  checkpoint, on the base's data: `demo.data_seed` 0), so arms differ only in what the arm changes and in
  the seed of the SFT stage (its row order).
- Seeds: every arm runs `--seeds` (default 0 1 2) as the `seed` of its branch; tables give mean ± sample sd
  over seeds, and `verdict` says whether a difference between two arms exceeds the seed spread.
- `--smoke`: one seed, research/smoke.yaml (the demo recipe with a handful of steps and samples), results
  under OUT/smoke/: the same code paths in a few minutes, no committed file touched.
- Demo runs whose wall time is not a result (the base, the branches) go `JOBS` at a time (`in_parallel`):
  one such run keeps ~1.1 of the 2 cores busy, two keep both. The base is trained first, alone, since every
  branch starts from it. Timed runs (experiment (d)'s throughput) go alone (research/run_all.sh).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's mindvl_ms
from mindvl_ms.config.base import deep_merge, read_yaml  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
OUT = os.environ.get("RESEARCH_OUT", "/tmp/mindvl_research")
RECIPE = os.path.join(REPO, "configs", "demo", "full.yaml")  # the demo's recipe: the base and every branch
SMOKE = os.path.join(HERE, "smoke.yaml")   # the same recipe, a few steps: `--smoke`
BASE_SEED = 0                              # the base's seed, hence the data every branch trains and scores on
# How a branch's SFT variants differ (MindVL section 5.3: longer rows with larger images): sft_256 sees every
# image at 3,136 px (56x56, 4 visual tokens), sft_512 keeps the recipe's 12,544 (16 tokens, the base's and
# the evaluation's size); tests/research/test_scale.py checks with the processor that the sizes differ.
VARIANT_IMAGES = {"sft_256": {"min_pixels": 3136, "max_pixels": 3136}}
# The branch's own evaluation: one resolution setting (the base's; experiment (b) runs the grid) and its
# phases in one process
BRANCH_DEMO = {"resolution_grid": {"min": [16], "max": [16]}, "phase_processes": False}
SEEDS = (0, 1, 2)
JOBS = int(os.environ.get("RESEARCH_JOBS", "2"))   # demo runs at once in `in_parallel` (2 cores)
SOURCE_DIRS = ("mindvl_ms", "configs", "scripts")          # the code and packaged configs a run depends on
SOURCE_EXTS = (".py", ".yaml", ".yml", ".json", ".sh", ".txt", ".cpp", ".h")
RESULT_FILES = ("results.json", "results.md", ".png", "resolution_table.md")


class Settings:
    """What `parse_args` chose: the seeds, smoke mode, the recipe and where results go."""
    seeds: Sequence[int] = SEEDS
    smoke = False
    recipe = RECIPE


S = Settings()


def parse_args(doc: str, argv: Optional[Sequence[str]] = None, add=None) -> argparse.Namespace:
    """The experiments' shared flags (--seeds, --smoke), plus any the experiment adds through `add(ap)`."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help=f"seeds per arm (default {list(SEEDS)})")
    ap.add_argument("--smoke", action="store_true",
                    help="one seed on research/smoke.yaml, results under $RESEARCH_OUT/smoke (nothing committed)")
    if add is not None:
        add(ap)
    args = ap.parse_args(argv)
    S.smoke = args.smoke
    S.recipe = SMOKE if args.smoke else RECIPE
    S.seeds = tuple(args.seeds) if args.seeds else ((0,) if args.smoke else SEEDS)
    args.seeds = list(S.seeds)
    return args


def results_dir(exp_dir: str) -> str:
    """Where an experiment writes its results: next to its run.py, or OUT/smoke/<experiment> with --smoke."""
    if not S.smoke:
        return exp_dir
    d = os.path.join(OUT, "smoke", os.path.basename(exp_dir))
    os.makedirs(d, exist_ok=True)
    return d


# ---- code version and cache keys ----------------------------------------------------------------------

def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()


def commit() -> str:
    """Short HEAD of the checkout the scripts run from, + '-dirty' when the code, configs or research/
    scripts have uncommitted edits (the experiments' own result files do not count)."""
    dirty = [ln for ln in _git("status", "--porcelain", "--", *SOURCE_DIRS, "research").splitlines()
             if not ln.rstrip().endswith(RESULT_FILES)]
    return _git("rev-parse", "--short", "HEAD") + ("-dirty" if dirty else "")


_SOURCE_HASH: Dict[str, str] = {}


def source_hash(root: str = REPO, dirs: Sequence[str] = SOURCE_DIRS) -> str:
    """sha256 over the paths and contents of the source files under `dirs` (computed once per process)."""
    key = f"{root}|{','.join(dirs)}"
    if key not in _SOURCE_HASH:
        h = hashlib.sha256()
        for d in dirs:
            for base, subdirs, files in os.walk(os.path.join(root, d)):
                subdirs[:] = sorted(s for s in subdirs if s != "__pycache__" and not s.startswith("."))
                for f in sorted(files):
                    if f.endswith(SOURCE_EXTS):
                        p = os.path.join(base, f)
                        h.update(os.path.relpath(p, root).encode() + b"\0")
                        with open(p, "rb") as fh:
                            h.update(hashlib.sha256(fh.read()).digest())
        _SOURCE_HASH[key] = h.hexdigest()
    return _SOURCE_HASH[key]


def config_digest(path: str) -> Any:
    """A config file as the run reads it: the YAML with its `_include_`s resolved (another file: its bytes)."""

    if path.endswith((".yaml", ".yml")):
        return read_yaml(path)
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def run_key(cmd: Sequence[str], configs: Sequence[str] = (), source: Optional[str] = None) -> str:
    """The cache key of a run: its command, the resolved config files and the code's source hash."""
    blob = {"cmd": [str(c) for c in cmd], "configs": {os.path.abspath(c): config_digest(c) for c in configs},
            "source": source if source is not None else source_hash()}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()


def mindvl(*args: str) -> List[str]:
    """The `mindvl` CLI of this checkout (python -m mindvl_ms with PYTHONPATH=REPO)."""
    return [sys.executable, "-m", "mindvl_ms", *args]


def env() -> Dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = REPO + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    return e


def run(cmd: Sequence[str], log_path: str) -> float:
    """Run cmd (stdout+stderr to log_path); raise with the log's tail on failure; returns seconds."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        rc = subprocess.run(list(cmd), cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT).returncode
    dt = time.perf_counter() - t0
    if rc != 0:
        with open(log_path, encoding="utf-8") as f:
            tail = "".join(f.readlines()[-30:])
        raise RuntimeError(f"command failed (exit {rc}) after {dt:.0f}s: {' '.join(cmd)}\n{tail}")
    print(f"  done in {dt:.0f}s (log {log_path})", flush=True)
    return dt


def load(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def demo(name: str, sets: Sequence[str] = (), config: Optional[str] = None) -> Dict[str, Any]:
    """`mindvl demo --config CONFIG --out OUT/runs/<key> --set ...`, cached by `run_key` (command with the
    out dir left out, the resolved CONFIG and the source hash); returns report.json with `wall_s` (this
    run's time, or the cached run's), `cached`, `commit` (the commit it was made at) and `key` added."""
    config = config or S.recipe
    args = ["demo", "--config", config, "--no-progress", *[a for s in sets for a in ("--set", s)]]
    key = run_key(args, [config])
    with _lock_of(key):   # one training per key, whichever thread asks first
        return _demo(name, args, key)


_LOCKS: Dict[str, threading.Lock] = {}
_REUSED: set = set()
_LOCKS_LOCK = threading.Lock()


def _lock_of(key: str) -> threading.Lock:
    with _LOCKS_LOCK:
        return _LOCKS.setdefault(key, threading.Lock())


def _demo(name: str, args: List[str], key: str) -> Dict[str, Any]:
    """`demo`'s run of `args` under its cache key: the cached report, or a fresh run."""
    out = os.path.join(OUT, "runs", key[:16])
    stamp = os.path.join(out, "research_key.json")
    if os.path.isfile(os.path.join(out, "report.json")) and os.path.isfile(stamp):
        old = load(stamp)
        if old["key"] == key:
            if key not in _REUSED:   # said once per process (every branch asks for the base)
                print(f"reusing {out} for {name} (same code and config, made at {old['commit']})", flush=True)
                _REUSED.add(key)
            return dict(load(os.path.join(out, "report.json")), wall_s=old["wall_s"], cached=True,
                        commit=old["commit"], key=key)
    shutil.rmtree(out, ignore_errors=True)  # what a failed or interrupted run left: start afresh
    dt = run(mindvl(*args[:3], "--out", out, *args[3:]), os.path.join(OUT, "logs", f"{name}-{key[:8]}.log"))
    with open(stamp, "w", encoding="utf-8") as f:
        json.dump({"key": key, "name": name, "args": args, "commit": commit(), "wall_s": dt}, f, indent=2)
    return dict(load(os.path.join(out, "report.json")), wall_s=dt, cached=False, commit=commit(), key=key)


def base() -> Dict[str, Any]:
    """The trained base: the demo recipe's whole run at BASE_SEED (its multitask checkpoint is what every
    `branch` starts from; its report is the demo's own seed-0 result)."""
    return demo("base", [f"seed={BASE_SEED}"])


def base_checkpoint(report: Dict[str, Any]) -> str:
    return report["stages"]["multitask"]["checkpoint"]


def branch_config(init_from: str, recipe: Optional[str] = None, eval_variants: bool = False) -> str:
    """A demo YAML (written under OUT/configs, named by its content) that is the recipe's last stage (the SFT
    variants, VARIANT_IMAGES applied, and their merge) alone, started from `init_from`, on the base's data
    (`demo.data_seed` BASE_SEED); the merged checkpoint is evaluated, the variants too with eval_variants."""
    raw = read_yaml(recipe or S.recipe)
    sft = dict(raw["stages"][-1])
    sft["variants"] = {name: deep_merge(v, {"data": {"image": VARIANT_IMAGES.get(name, {})}})
                       for name, v in sft["variants"].items()}
    raw["stages"] = [sft]
    raw["init_from"] = os.path.abspath(init_from)   # the run config's own: variants of a first stage start there
    raw["demo"] = dict(raw["demo"], eval_variants=eval_variants, data_seed=BASE_SEED, **BRANCH_DEMO)
    text = yaml.safe_dump(raw, sort_keys=True)
    path = os.path.join(OUT, "configs", hashlib.sha256(text.encode()).hexdigest()[:16] + ".yaml")
    if not os.path.isfile(path):   # named by its content: an existing file is this one (a running branch reads it)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    return path


def branch(name: str, seed: int, sets: Sequence[str] = (), eval_variants: bool = False) -> Dict[str, Any]:
    """An arm: the SFT stage from the base's multitask checkpoint with `seed` and `sets` (stage index 0 = that
    stage), cached like any demo run (the base checkpoint's path, hence the base's key, is in the config)."""
    rep = base()
    return dict(demo(f"{name}_seed{seed}", [f"seed={seed}", *sets],
                     branch_config(base_checkpoint(rep), eval_variants=eval_variants)), base_commit=rep["commit"])


def in_parallel(calls: Sequence[Callable[[], Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """[call() for call in calls], up to JOBS at a time (threads waiting on their `mindvl demo` subprocesses),
    in order. The base is trained first, alone: every branch starts from its checkpoint."""
    base()
    with ThreadPoolExecutor(max(1, JOBS)) as pool:
        return list(pool.map(lambda call: call(), calls))


def runs_by_arm(arms: Sequence[str], seeds: Sequence[int],
                run: Callable[[str, int], Dict[str, Any]]) -> Dict[str, List[Dict[str, Any]]]:
    """{arm: [run(arm, seed) for seed in seeds]}, the runs made `in_parallel`."""
    flat = in_parallel([lambda a=a, s=s: run(a, s) for a in arms for s in seeds])
    return {a: flat[i * len(seeds):(i + 1) * len(seeds)] for i, a in enumerate(arms)}


def recipe_runs(seeds: Sequence[int]) -> Dict[str, Callable[[], Dict[str, Any]]]:
    """`demo_runs` of an experiment that reads the recipe branch of each seed ((a), (b)): {label: call}."""
    return {f"sft_seed{s}": (lambda s=s: recipe_branch(s)) for s in seeds}


def recipe_branch(seed: int) -> Dict[str, Any]:
    """The recipe's SFT stage as it is, variants scored too: experiment (a)'s run of a seed, whose merged
    checkpoint (b) searches and whose merged scores are the recipe's arm of (c) and (e) (one run, shared)."""
    return branch("sft", seed, eval_variants=True)


# ---- the torch reference runs ((f), (g)) ----------------------------------------------------------------

def train_views(step, evaluate, views: int, every: int, batch: int = 32) -> List[Dict[str, Any]]:
    """Run `step()` (one optimizer step on `batch` samples) until `views` samples are seen; after the step
    that crosses each multiple of `every`, append {"views": seen, **evaluate(seen)} to the returned curve."""
    curve, seen = [], 0
    while seen < views:
        step()
        seen += batch
        if seen // every != (seen - batch) // every:
            curve.append({"views": seen, **evaluate(seen)})
    return curve


def check_views(views: int, every: int) -> int:
    """`views` when it holds at least one evaluation (`every` views); else exit naming --views and the minimum
    (a shorter run would give an empty curve and no table)."""
    if views < every:
        raise SystemExit(f"--views {views}: need at least {every:,} (one evaluation every {every:,} views)")
    return views


def first_at(curve: Sequence[Dict[str, Any]], key: str, level: float) -> Optional[int]:
    """The views of the first point of `curve` whose `key` is at or above `level`, or None."""
    return next((p["views"] for p in curve if p[key] >= level), None)


# ---- statistics and tables ----------------------------------------------------------------------------

def mean_sd(values: Sequence[float]) -> tuple:
    """(mean, sample sd) of per-seed values; sd is None for one value."""
    v = np.asarray(values, dtype=np.float64)
    return float(v.mean()), (float(v.std(ddof=1)) if len(v) > 1 else None)


def fmt(values: Sequence[float], scale: float = 100.0, digits: int = 1) -> str:
    """'m ± sd' over seeds (scaled, e.g. to %); 'm' alone for one seed."""
    m, sd = mean_sd(values)
    return f"{scale * m:.{digits}f}" + ("" if sd is None else f" ± {scale * sd:.{digits}f}")


def verdict(a: Sequence[float], b: Sequence[float]) -> str:
    """Whether arms a and b differ beyond the seed spread: their means differ by more than the sum of their
    sample sds (the mean ± sd intervals do not overlap). Needs >= 2 seeds per arm."""
    (ma, sa), (mb, sb) = mean_sd(a), mean_sd(b)
    if sa is None or sb is None:
        return "untestable (one seed)"
    if abs(ma - mb) > sa + sb:
        return "exceeds the seed spread"
    return "within the seed spread"


def arms_table(arms: Dict[str, Dict[str, Sequence[float]]], metrics: Sequence[str], headers: Sequence[str],
               reference: str, on: str = "average") -> str:
    """One row per arm: mean ± sd of each metric over seeds, and the verdict on metric `on` against the
    reference arm (a row's own verdict for the reference: '-')."""
    rows = []
    for a, m in arms.items():
        rows.append([a] + [fmt(m[k]) for k in metrics]
                    + ["-" if a == reference else verdict(m[on], arms[reference][on])])
    return md_table(["arm", *headers, f"{on}: vs {reference}"], rows)


def effect_sentence(arms: Dict[str, Dict[str, Sequence[float]]], reference: str, on: str = "average") -> str:
    """The README/results.md statement of whether any arm's effect exceeds the seed spread."""
    others = [a for a in arms if a != reference]
    verdicts = {a: verdict(arms[a][on], arms[reference][on]) for a in others}
    beyond = [a for a, v in verdicts.items() if v == "exceeds the seed spread"]
    n = len(next(iter(arms.values()))[on])
    if n < 2:
        return f"Effect vs {reference}: untestable with one seed."
    if beyond:
        return f"Effect vs {reference} on {on}: exceeds the seed spread for {', '.join(beyond)}."
    return f"Effect vs {reference} on {on}: no arm differs beyond the seed spread ({n} seeds, mean ± sd)."


def blind_rows(base_report: Dict[str, Any], tasks: Sequence[str], trailing: int = 2) -> str:
    """Table rows of the base's image-blind references under an arms table (one base, one data draw): each
    task's baseline (majority answer, chance, mean box) and easy-VQA's question prior (the most frequent
    train answer of each question template), the stronger blind reference for VQA; `trailing` empty cells."""
    b = base_report["baselines"]
    tail = " |" * trailing
    rows = ["| blind baseline | " + " | ".join(pct(b[t]["score"]) for t in tasks) + " |" + tail]
    if "question_prior" in b.get("vqa", {}):
        rows.append("| VQA question prior (image-blind) | " + " | ".join(
            pct(b["vqa"]["question_prior"]) if t == "vqa" else "" for t in tasks) + " |" + tail)
    return "\n".join(rows) + "\n"


def header(seeds: Sequence[int]) -> str:
    """The line every results.md starts with: the commit, source hash and seeds the table was made at."""
    return (f"Made at commit {commit()} (source hash {source_hash()[:12]}), seeds {list(seeds)}"
            + (", --smoke (a few samples and steps)" if S.smoke else "") + ".")


def save(exp_dir: str, results: Dict[str, Any], table: str) -> None:
    """results.json (with the commit, source hash and time) and results.md (headed by the commit) in
    `results_dir(exp_dir)`."""
    d = results_dir(exp_dir)
    results = dict(results, commit=commit(), source_hash=source_hash(), smoke=S.smoke,
                   finished_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()))
    with open(os.path.join(d, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2, default=str)
    text = header(results.get("seeds", S.seeds)) + "\n\n" + table.rstrip() + "\n"
    with open(os.path.join(d, "results.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text, flush=True)


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(str(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def bar_plot(arms: Dict[str, Dict[str, Sequence[float]]], tasks: Sequence[str], blind: Optional[Dict[str, float]],
             path: str, title: str) -> None:
    """Bars of mean ± sd per task and arm (held-out %), the seeds as dots, the blind baseline as a dash."""
    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(7.5, 3.8))
    w = 0.8 / len(arms)
    x = np.arange(len(tasks))
    for i, (a, m) in enumerate(arms.items()):
        pos = x + (i - (len(arms) - 1) / 2) * w
        vals = [100 * np.asarray(m[t], dtype=np.float64) for t in tasks]
        ax.bar(pos, [v.mean() for v in vals], w, yerr=[v.std(ddof=1) if len(v) > 1 else 0 for v in vals],
               capsize=3, label=a)
        for p, v in zip(pos, vals):
            ax.scatter(np.full(len(v), p), v, color="k", s=8, zorder=3)
    if blind:
        ax.scatter(x, [100 * blind[t] for t in tasks], marker="_", s=600, color="grey", label="blind baseline",
                   zorder=4)
    ax.set_xticks(x, list(tasks))
    ax.set_ylabel("held-out % (bars: mean ± sd, dots: seeds)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot.close(fig)
