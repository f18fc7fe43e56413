"""Load research/ scripts as modules (they import `common` from their own folder's parent)."""
import importlib.util
import os
import sys

from tests.support.paths import ROOT

RESEARCH = os.path.join(ROOT, "research")


def load(rel: str, name: str):
    """research/<rel> as a module called `name`, with research/ on sys.path (for its `import common`)."""
    if RESEARCH not in sys.path:
        sys.path.insert(0, RESEARCH)
    spec = importlib.util.spec_from_file_location(name, os.path.join(RESEARCH, rel))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
