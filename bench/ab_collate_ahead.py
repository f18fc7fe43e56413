"""The demo's multitask step with and without collating the next batch on a thread (train/batches.CollateAhead).

    python bench/ab_collate_ahead.py [--blocks 16] [--steps 10]

One process, one compiled step: blocks of steps alternate between the two ways (the first step of each block
is not timed), so drift in the machine's load reaches both alike. Prints the median and mean per step of each.
"""
import argparse
import os
import statistics
import tempfile
import time

from profile_train import setup_demo


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=16, help="alternating blocks (half of them each way)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per block")
    ap.add_argument("--data", default=None, help="a demo run's OUT/data (default: a small set)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        step, _, trainer = setup_demo(args.data, d)
        ahead = trainer._collate_next
        for _ in range(5):  # compile and warm up
            step()
        walls = {"collate ahead": [], "collate after the draw": []}
        for b in range(args.blocks):
            way = "collate ahead" if b % 2 else "collate after the draw"
            trainer._collate_next = ahead if b % 2 else (lambda: None)
            step()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step()
                walls[way].append(time.perf_counter() - t0)
    for way, w in walls.items():
        print(f"{way:24s} median {1e3 * statistics.median(w):7.1f} ms  mean {1e3 * statistics.mean(w):7.1f} ms  "
              f"({len(w)} steps)")
    med = {k: statistics.median(v) for k, v in walls.items()}
    print(f"load {os.getloadavg()[0]:.2f}; ahead / after: {med['collate ahead'] / med['collate after the draw']:.3f}")


if __name__ == "__main__":
    main()
