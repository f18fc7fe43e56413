"""Where the train step's memory goes: resident memory (RSS) after each phase of the bench_train step
(same model, same packed batch, same compiled graphs), and the peak use of MindSpore's memory pool.

    python bench/profile_memory.py [--config small] [--steps 3] [--rows 1]

The step runs in a child process with `MS_DEV_RUNTIME_CONF=memory_statistics:True`, so MindSpore prints
its pool statistics when the child exits (`mindspore.runtime.memory_stats()` reports zeros on CPU). Printed:
- RSS and its change after each phase, read from /proc/self/status: imports; the model loaded; the
  `TrainStep` built (its fp32 gradient accumulators, one copy of the trainable parameters); the micro-step
  graph compiled; its first run (forward, backward, accumulation); the gradient norm; the first AdamW
  update (the moments are materialised on first use); then whole steps;
- the process's peak RSS, and the pool's reserved size and peak use;
- the largest resident mappings at the end (/proc/self/smaps): the pool's block, the big tensors, the heap.
Its figures for `small`, with bench_train's peak RSS beside them, are in docs/PERFORMANCE.md, ## bench.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("GLOG_v", "3")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def rss_mb():
    """(current RSS, peak RSS) of this process in MB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out["VmRSS"], out["VmHWM"]


def largest_mappings(top: int):
    """[(RSS MB, mapping description)] of the `top` largest resident mappings."""
    maps, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if not head.endswith(":") or "-" in head:  # a mapping's header line
                cur = " ".join(line.split()[5:]) or "[anonymous]"
            elif head == "Rss:":
                maps.append((int(line.split()[1]) / 1024, cur))
    return sorted(maps, reverse=True)[:top]


class _Phase:
    """Calls the wrapped graph cell and reports RSS after the first call."""

    def __init__(self, cell, name, report):
        self.__dict__.update(_cell=cell, _name=name, _report=report, _done=False)

    def __getattr__(self, key):
        return getattr(self._cell, key)

    def __call__(self, *args):
        out = self._cell(*args)
        if not self._done:
            self.__dict__["_done"] = True
            self._report(self._name)
        return out


def child(path: str, rows: int, steps: int) -> None:
    def report(phase):
        print("PHASE " + json.dumps({"phase": phase, "rss": rss_mb()}), flush=True)

    report("python started")
    import mindspore  # noqa: F401  (the imports phase)

    from bench_train import ms_engine
    from mindvl_ms.data.collate import build_model_inputs
    from mindvl_ms.models.mindvl import MindVLModel  # noqa: F401  (the imports phase)

    report("imports")
    model, eng, data, length = ms_engine(path, rows, report)
    batch = build_model_inputs(data, model.config, pad_to=length)
    eng.compile_micro(eng._feeds([batch])[0])  # as TrainStep.run's first call: compile, then release the freed heap
    report("micro-step graph compiled")
    eng.micro = _Phase(eng.micro, "micro-step first run (forward, backward, accumulate)", report)
    eng.reduce = _Phase(eng.reduce, "gradient norm", report)
    eng.update = _Phase(eng.update, "first AdamW update (moments materialised)", report)
    for i in range(steps):
        loss = eng.run([build_model_inputs(data, model.config, pad_to=length)], 1e-4).loss
        report(f"step {i + 1} done (loss {loss:.4f})")
    print("MAPS " + json.dumps(largest_mappings(6)), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="small", help="bench_model size: tiny or small")
    ap.add_argument("--steps", type=int, default=3, help="whole train steps after the phases")
    ap.add_argument("--rows", type=int, default=1, help="packed rows per batch")
    ap.add_argument("--child", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.rows, args.steps)
        return
    from bench_model import SIZES, build_hf

    if args.config not in SIZES:
        raise SystemExit(f"--config {args.config}: expected one of {sorted(SIZES)}")
    with tempfile.TemporaryDirectory() as d:
        build_hf(args.config, vocab=151936).save_pretrained(d)
        env = dict(os.environ, MS_DEV_RUNTIME_CONF="memory_statistics:True")
        p = subprocess.run([sys.executable, __file__, "--child", d, "--rows", str(args.rows), "--steps",
                            str(args.steps)], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"child failed:\n{p.stderr[-4000:]}")
    out = p.stdout + p.stderr
    print(f"{args.config}: RSS after each phase (MB)")
    print(f"  {'phase':55s} {'RSS':>7s} {'change':>7s} {'peak':>7s}")
    prev = None
    for line in out.splitlines():
        if line.startswith("PHASE "):
            r = json.loads(line[6:])
            now, peak = r["rss"]
            change = "" if prev is None else f"{now - prev:+7.0f}"
            print(f"  {r['phase']:55s} {now:7.0f} {change:>7s} {peak:7.0f}")
            prev = now
    pool = re.search(r"dynamic memory pool total allocated mem:(\d+)M.*?peak used mem:(\d+)M", out)
    if pool:
        print(f"MindSpore memory pool: {pool.group(1)} MB reserved, peak use {pool.group(2)} MB")
    else:
        print("MindSpore memory pool: no statistics line in the child's output")
    for line in out.splitlines():
        if line.startswith("MAPS "):
            print("largest resident mappings at the end (MB):")
            for mb, name in json.loads(line[5:]):
                print(f"  {mb:7.0f}  {name}")


if __name__ == "__main__":
    main()
