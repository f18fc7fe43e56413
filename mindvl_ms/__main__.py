import sys

from mindvl_ms.cli import main

if __name__ == "__main__":
    sys.exit(main())
