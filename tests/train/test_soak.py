"""Kill/resume soak of `run_training` on the tiny stand-in: 100 steps with a checkpoint every 20, killed with
SIGKILL at 5 points drawn by a seeded RNG and resumed from the run directory's latest checkpoint each time
(the trainer's own resume; started afresh in the same directory when a kill came before the first complete
checkpoint), ends with weights, optimizer state, trainer state and logged losses bitwise equal to an
uninterrupted run's, and with only complete checkpoints on disk. The five killed runs are worker
processes; the uninterrupted run and the last resume, which nothing kills, run in the test's process.

The kill points (tests/workers/soak.py says where each kind lands): one in the middle of a step, one in
the middle of a save (weights written, optimizer state not), one between a complete checkpoint and the
latest.json that names it, and two from outside after the worker reached a drawn step plus a drawn
delay, which land anywhere (in a step, in a save, between them). MINDVL_SOAK_SEED draws another plan.
"""
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mindvl_ms.checkpoint import trainer_state as ts
from tests.support.paths import ROOT
from tests.workers.soak import SAVE_EVERY, STEPS, train

WORKER = os.path.join(ROOT, "tests", "workers", "soak.py")
SEED = int(os.environ.get("MINDVL_SOAK_SEED", "19"))
KINDS = ("step", "weights", "latest", "clock", "clock")
TIMEOUT = 600


def kill_plan(seed):
    """[(step, kind, delay_s)] sorted by step, distinct steps: save kills at a periodic or the stage-end
    save, the others anywhere in the run (clock kills early enough that the run cannot end first)."""
    rng = random.Random(seed)
    while True:
        plan = []
        for kind in KINDS:
            if kind in ("weights", "latest"):
                plan.append((rng.randrange(SAVE_EVERY, STEPS + 1, SAVE_EVERY), kind, 0.0))
            elif kind == "step":
                plan.append((rng.randrange(1, STEPS), kind, 0.0))
            else:
                plan.append((rng.randrange(1, STEPS - 60), kind, rng.uniform(0.0, 0.1)))
        if len({p[0] for p in plan}) == len(plan):
            return sorted(plan)


def launch(out, progress, log, resume, kill=None):
    if os.path.exists(progress):
        os.remove(progress)
    cmd = [sys.executable, WORKER, out, progress] + (["--resume"] if resume else [])
    if kill is not None and kill[1] != "clock":
        cmd += ["--kill", kill[1], "--at", str(kill[0])]
    # MindSpore's compile cache: the first worker saves its graphs, the next ones (the same script, network and
    # graphs, compiled in the same order) load them instead of compiling again
    env = dict(os.environ, GLOG_v="3", PYTHONPATH=ROOT, MS_COMPILER_CACHE_ENABLE="1",
               MS_COMPILER_CACHE_PATH=os.path.join(os.path.dirname(out), "compile_cache"))
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


def tail(log):
    with open(log) as f:
        return f.read()[-3000:]


def progress_of(path):
    try:
        with open(path) as f:
            return int(f.read().strip() or -1)
    except (OSError, ValueError):
        return -1


def kill_from_outside(proc, progress, at, delay, log):
    """SIGKILL the worker `delay` seconds after it draws step `at` or a later one."""
    deadline = time.monotonic() + TIMEOUT
    while progress_of(progress) < at:
        assert proc.poll() is None, f"worker exited ({proc.returncode}) before step {at}:\n{tail(log)}"
        assert time.monotonic() < deadline, f"worker did not reach step {at}:\n{tail(log)}"
        time.sleep(0.002)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)


def latest_step(out):
    path = os.path.join(out, ts.LATEST)
    if not os.path.isfile(path):
        return None
    ck = ts.find_latest(out)  # raises when latest.json names an incomplete checkpoint
    state, _, _ = ts.load_checkpoint(ck)
    return state["step"]


def check_after_kill(out, kill, landed):
    """latest.json (if any) names a complete checkpoint, the one the kill point leaves as the resume point;
    `landed` is the last step the worker drew. Returns the resume point and whether a save was cut short."""
    at, kind, _ = kill
    stage_dir = os.path.join(out, "sft")
    got = latest_step(out)
    names = os.listdir(stage_dir) if os.path.isdir(stage_dir) else []
    before = (at - SAVE_EVERY) or None  # the save before `at` (none before the first)
    if kind == "step":
        assert got == ((at // SAVE_EVERY) * SAVE_EVERY or None), (kill, got)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            assert json.loads(f.readlines()[-1])["step"] == at - 1, kill
    elif kind == "weights":
        assert got == before and f"checkpoint-{at:06d}" not in names, (kill, got, names)
        assert [n for n in names if n.startswith(f".checkpoint-{at:06d}.tmp-")], names  # the half-written save
    elif kind == "latest":
        assert got == before and ts.is_complete(os.path.join(stage_dir, f"checkpoint-{at:06d}")), (kill, got)
    else:  # every save up to the drawn step is done; the next one may be too (killed before the next draw)
        assert (got is None and landed < SAVE_EVERY) or (
            got % SAVE_EVERY == 0 and landed - SAVE_EVERY < got <= landed + 1), (kill, landed, got)
    return got, any(".tmp-" in n for n in os.listdir(stage_dir)) if os.path.isdir(stage_dir) else False


def assert_bitwise(want, got, name):
    assert want.dtype == got.dtype and want.shape == got.shape, (name, want.dtype, got.dtype, want.shape, got.shape)
    if not np.array_equal(want, got):
        diff = np.abs(want.astype(np.float64) - got.astype(np.float64))
        raise AssertionError(f"{name}: {int((want != got).sum())} of {want.size} values differ from the "
                             f"uninterrupted run's (largest difference {diff.max():.3g})")


def final_state(out):
    ck = os.path.join(out, "sft", f"checkpoint-{STEPS:06d}")
    assert ts.find_latest(out) == ck
    return ts.load_checkpoint(ck)


def losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, f)]


def assert_checkpoints_complete(out):
    stage_dir = os.path.join(out, "sft")
    names = sorted(os.listdir(stage_dir))
    assert not [n for n in names if ".tmp-" in n], names
    cks = [n for n in names if n.startswith("checkpoint-")]
    assert cks and cks[-1] == f"checkpoint-{STEPS:06d}", cks
    for n in cks:
        path = os.path.join(stage_dir, n)
        assert ts.is_complete(path), path
        state, tensors, optim = ts.load_checkpoint(path)  # every file reads back whole
        assert state["step"] == int(n.split("-")[1]) and tensors and optim, path


def soak(out, progress, log, plan):
    """Run the plan's kills one after another, each in a worker process resumed from `out`'s latest
    checkpoint, then run to the end (in this process: nothing kills it); returns the last step each killed
    worker drew and (resume point, save cut short) after each kill."""
    landed_at, resumed_from = [], []
    for kill in plan:
        resume = os.path.isfile(os.path.join(out, ts.LATEST))
        proc = launch(out, progress, log, resume, kill)
        try:
            if kill[1] == "clock":
                kill_from_outside(proc, progress, kill[0], kill[2], log)
            rc = proc.wait(timeout=TIMEOUT)
        finally:
            stop(proc)
        assert rc == -signal.SIGKILL, f"kill {kill}: worker exited with {rc}:\n{tail(log)}"
        landed_at.append(progress_of(progress))
        resumed_from.append(check_after_kill(out, kill, landed_at[-1]))
    ends = [(r["stage"], r["checkpoint"]) for r in train(out, progress, resume=True)["stages"]]
    assert ends == [("sft", os.path.join(out, "sft", f"checkpoint-{STEPS:06d}"))], ends  # ran to the end
    return landed_at, resumed_from


def stop(proc):
    """Kill a worker this test started that is still running (after a failed check)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.slow  # five worker processes, each importing MindSpore and compiling the step, and 200+ steps
def test_killed_and_resumed_five_times_ends_bitwise_equal(tmp_path):
    ref, out = str(tmp_path / "ref"), str(tmp_path / "soak")
    t0, plan = time.monotonic(), kill_plan(SEED)
    ends = [(r["stage"], r["checkpoint"]) for r in train(ref, str(tmp_path / "ref.progress"))["stages"]]
    assert ends == [("sft", os.path.join(ref, "sft", f"checkpoint-{STEPS:06d}"))], ends  # uninterrupted, here
    landed_at, resumed_from = soak(out, str(tmp_path / "soak.progress"), str(tmp_path / "soak.log"), plan)
    print(f"\nsoak seed {SEED}: kills (step, kind, delay) {[(a, k, round(d, 3)) for a, k, d in plan]}, "
          f"last steps drawn {landed_at}, (resume point, save cut short) {resumed_from}, "
          f"{time.monotonic() - t0:.1f} s")

    want, got = final_state(ref), final_state(out)
    assert sorted(want[1]) == sorted(got[1]) and sorted(want[2]) == sorted(got[2])
    for k in want[1]:
        assert want[1][k].dtype == got[1][k].dtype, k
        assert_bitwise(want[1][k].data, got[1][k].data, k)
    for k in want[2]:
        assert_bitwise(want[2][k], got[2][k], k)                       # AdamW moments, step, loss scale
    for key in ("step", "data", "rng", "skipped", "nonfinite_run", "stage_done"):
        assert want[0][key] == got[0][key], key
    ref_losses = losses(ref)
    assert [s for s, _, _ in ref_losses] == list(range(STEPS))
    assert losses(out) == ref_losses                                    # every step's loss and grad norm
    assert_checkpoints_complete(out)
    assert_checkpoints_complete(ref)
