"""msrun task script that runs the `mindvl` command line (msrun launches a script, not a console entry).

    msrun --worker_num=2 ... scripts/mindvl_worker.py train --config run.yaml
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mindvl_ms.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
