"""Train every demo run the named experiments read, up to `common.JOBS` at a time across experiments.

    python research/prefetch.py merge_vs_sft balanced_loss grounding_share resolution_search [--smoke] [--seeds ...]

Each demo-based experiment's run.py lists its runs (`demo_runs(seeds)`: {label: call}); a run two experiments
share (the recipe branch of a seed) has one label and is trained once. Run before the experiments
(research/run_all.sh does), the pool is shared by all of them, so no core idles while one experiment's last
run finishes; each experiment then reads its runs from the cache (`common.demo`). The longest runs (the recipe
branches, whose three checkpoints are scored) go first.
"""
import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def experiment(name):
    """research/<name>/run.py as a module (its main() not run)."""
    spec = importlib.util.spec_from_file_location(f"research_{name}", os.path.join(HERE, name, "run.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def needed(names, seeds):
    """{label: call} over the experiments' `demo_runs`, the recipe branches ('sft_seed*') first."""
    runs = {}
    for n in names:
        mod = experiment(n)
        if not hasattr(mod, "demo_runs"):
            raise SystemExit(f"research/{n}/run.py has no demo_runs(seeds): not a demo-based experiment")
        runs.update(mod.demo_runs(seeds))
    return dict(sorted(runs.items(), key=lambda kv: not kv[0].startswith("sft_seed")))


def main():
    args = common.parse_args(__doc__, add=lambda ap: ap.add_argument(
        "experiments", nargs="+", help="experiment folders under research/ with a demo_runs(seeds)"))
    runs = needed(args.experiments, args.seeds)
    print(f"prefetch: {len(runs)} demo runs, {common.JOBS} at a time: {', '.join(runs)}", flush=True)
    common.in_parallel(list(runs.values()))


if __name__ == "__main__":
    main()
