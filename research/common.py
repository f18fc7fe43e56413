"""Shared helpers of the research/ experiments: run the project's commands, cache runs, record results.

Every experiment's `run.py` calls the project's own entry points (`mindvl demo`, `mindvl data pack`,
`mindvl train`, or the Python APIs behind them) and writes small result files next to itself:
results.json (numbers, seeds, commit, wall time), results.md (the table) and a PNG plot.

Design choices:
- Bulky outputs (data, checkpoints, predictions) go under $RESEARCH_OUT (default /tmp/mindvl_research),
  never into git.
- A demo run is keyed by a name; `demo()` skips a run whose report.json exists with the same command,
  so experiments that share an arm (the seed-0 quick run is the token-mean arm of the loss experiment
  and the 2x arm of the grounding-share experiment) train it once within one `run_all.sh`.
- Runs go one at a time (subprocess, waited for): the machine is small and timings must not overlap.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
OUT = os.environ.get("RESEARCH_OUT", "/tmp/mindvl_research")
SCALE = os.path.join(HERE, "scale.yaml")   # the demo-sized recipe every demo-based experiment starts from


def commit() -> str:
    """Short commit of the checkout the scripts run from (+'-dirty' when research/ or the code has edits)."""
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                         text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "mindvl_ms", "configs", "research"],
                           cwd=REPO, capture_output=True, text=True).stdout.strip()
    # result files of the experiments themselves do not make the code dirty
    dirty = [ln for ln in dirty.splitlines() if not ln.rstrip().endswith(
        ("results.json", "results.md", ".png"))]
    return sha + ("-dirty" if dirty else "")


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


def demo(name: str, sets: Sequence[str] = (), config: str = SCALE) -> Dict[str, Any]:
    """`mindvl demo --config CONFIG --out OUT/name --set ...`, cached by name + command; returns report.json
    with `wall_s` (this run's time, or the cached run's) and `cached` added."""
    out = os.path.join(OUT, name)
    cmd = mindvl("demo", "--config", config, "--out", out, "--no-progress", *[a for s in sets for a in ("--set", s)])
    stamp = os.path.join(out, "research_cmd.json")
    key = {"cmd": cmd[2:], "commit": commit()}
    if os.path.isfile(os.path.join(out, "report.json")) and os.path.isfile(stamp):
        with open(stamp, encoding="utf-8") as f:
            old = json.load(f)
        if old["cmd"] == key["cmd"]:
            print(f"reusing {out} (same command, run at {old['commit']})", flush=True)
            return dict(load(os.path.join(out, "report.json")), wall_s=old["wall_s"], cached=True,
                        commit=old["commit"])
    dt = run(cmd, os.path.join(OUT, "logs", f"{name}.log"))
    with open(stamp, "w", encoding="utf-8") as f:
        json.dump(dict(key, wall_s=dt), f, indent=2)
    return dict(load(os.path.join(out, "report.json")), wall_s=dt, cached=False, commit=key["commit"])


def load(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def save(exp_dir: str, results: Dict[str, Any], table: str) -> None:
    """results.json (with the commit and the time) and results.md next to the experiment's run.py."""
    results = dict(results, commit=commit(), finished_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()))
    with open(os.path.join(exp_dir, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2, default=str)
    with open(os.path.join(exp_dir, "results.md"), "w", encoding="utf-8") as f:
        f.write(table.rstrip() + "\n")
    print(table, flush=True)


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
