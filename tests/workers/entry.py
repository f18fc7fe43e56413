"""What msrun runs for a test's worker script (tests/support/msrun.py `launch`): msrun starts its scheduler as
one more process of the same command (MS_ROLE=MS_SCHED), which here schedules at once, without importing the
worker script's modules (trainer, models, data); the workers run SCRIPT as __main__ with its ARGS.

    scripts/msrun_train.sh 2 tests/workers/entry.py tests/workers/train_msrun.py OUT_DIR
"""
import runpy
import sys

from tests.support.msrun import schedule_only

if __name__ == "__main__":
    schedule_only()  # the scheduler's process ends here
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
