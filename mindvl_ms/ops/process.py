"""Process-wide setting for a process that compiles MindSpore graphs.

MindSpore runs a full `gc.collect()` before every Cell graph compile (`_CellGraphExecutor.compile`). A full
collection visits every tracked Python object, and most of them are the imported modules' (about 200,000
for MindSpore alone, 500,000 with torch and transformers next to it), none of which can ever be garbage. A
process that compiles a graph per stage, per cell or per test pays that traversal each time.
`freeze_imported_objects` moves the objects alive now into the collector's permanent generation
(`gc.freeze`), so later collections visit only what the run creates afterwards. Figures in
docs/PERFORMANCE.md, ## tests.

Call it after the heavy imports and before the first compile. It collects first, so nothing that is already
garbage is frozen. What is frozen is never collected, so a process freezes once: when something is frozen
already (an earlier `mindvl` command in the same process, a test session, an earlier demo phase), the call
does nothing, and a process that runs job after job does not pin the models of its earlier jobs.
"""
import gc


def freeze_imported_objects() -> int:
    """Unless the process has frozen objects already: collect garbage, then exclude every live object from future
    collections. Returns how many objects are frozen."""
    if not gc.get_freeze_count():
        gc.collect()
        gc.freeze()
    return gc.get_freeze_count()
