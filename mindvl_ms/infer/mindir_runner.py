"""Run exported MindIR graphs end to end (vision -> prefill -> decode loop) from an export directory.

    runner = ExportedRunner("out/export")                   # reads export.json, loads the three graphs
    ids = runner.generate([{"input_ids": ids, "pixel_frames": frames, "image_grid_thw": grid}], 16)

Execution backends, chosen at load time:
- MindSpore Lite (`mindspore_lite`, when importable): `mslite.Model().build_from_file(path,
  ModelType.MINDIR, context)` on the CPU target, `resize` to each call's shapes, `predict`. The cloud-side
  Lite runtime loads MindIR files exported by `mindspore.export` directly. No Lite wheel installs on this
  Python version, so this path is guarded (import check) and not exercised by the tests here.
- otherwise `mindspore.nn.GraphCell(mindspore.load(path))`, which executes the same serialized graphs.
`backend="graphcell"` or `backend="lite"` forces one.

The host-side loop is `engine.Engine`, the same code the eager model uses, driven by the EngineSpec stored
in export.json; images must come as uint8 `pixel_frames` (the exported vision graph normalises them).
The export directory is verified against its checksums.json before the graphs load.
"""
import json
import os
from typing import Dict, List, Sequence

import numpy as np

import mindspore as ms
from mindspore import Tensor

try:  # optional: no Lite wheel installs on every Python version
    import mindspore_lite as mslite
except ImportError:
    mslite = None

from mindvl_ms.checkpoint.integrity import verify_checkpoint
from mindvl_ms.infer.engine import Engine, EngineSpec
from mindvl_ms.infer.export import EXPORT_JSON, FORMAT
from mindvl_ms.infer.kv_cache import DECODE_NAMES, PREFILL_NAMES, VISION_META
from mindvl_ms.infer.sampling import SamplingConfig


def lite_available() -> bool:
    return mslite is not None


class GraphCellGraph:
    """One exported graph executed by mindspore.nn.GraphCell; inputs/outputs are numpy or ms Tensors."""

    def __init__(self, path: str):
        self.cell = ms.nn.GraphCell(ms.load(path))

    def __call__(self, *arrays):
        out = self.cell(*[a if isinstance(a, Tensor) else Tensor(a) for a in arrays])
        return out if isinstance(out, (tuple, list)) else (out,)


class LiteGraph:
    """One exported graph executed by MindSpore Lite (CPU target)."""

    def __init__(self, path: str):
        ctx = mslite.Context()
        ctx.target = ["cpu"]
        self.model = mslite.Model()
        self.model.build_from_file(path, mslite.ModelType.MINDIR, ctx)

    def __call__(self, *arrays):
        arrays = [np.ascontiguousarray(np.asarray(a)) for a in arrays]
        inputs = self.model.get_inputs()
        self.model.resize(inputs, [list(a.shape) for a in arrays])
        for t, a in zip(inputs, arrays):
            t.set_data_from_numpy(a)
        return [o.get_data_to_numpy() for o in self.model.predict(inputs)]


def _np(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.asnumpy()


class GraphBackend:
    """The Engine backend over exported graphs (see the module docstring)."""

    def __init__(self, export_dir: str, backend: str = "auto"):
        fn = os.path.join(export_dir, EXPORT_JSON)
        if not os.path.isfile(fn):
            raise FileNotFoundError(f"{export_dir}: no {EXPORT_JSON} (run `mindvl export` first)")
        verify_checkpoint(export_dir, model_only=False)  # the export's checksums.json, when it has one
        with open(fn, encoding="utf-8") as f:
            self.meta = json.load(f)
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{fn}: format {self.meta.get('format')!r}, expected {FORMAT!r}")
        self.spec = EngineSpec(**self.meta["engine"])
        if backend == "auto":
            backend = "lite" if lite_available() else "graphcell"
        if backend not in ("lite", "graphcell"):
            raise ValueError(f"backend must be auto, lite or graphcell, got {backend!r}")
        self.kind = backend
        cls = LiteGraph if backend == "lite" else GraphCellGraph
        self.graphs = {}
        for name, g in self.meta["graphs"].items():
            path = os.path.join(export_dir, g["file"])
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{export_dir}: missing exported graph {g['file']}")
            self.graphs[name] = cls(path)
        self.cache_shape = self.meta["kv_cache"]["shape"]

    def vision(self, pixels: np.ndarray, meta: Dict[str, np.ndarray], uint8: bool) -> np.ndarray:
        if not uint8:  # videos: float temporal patches
            if "vision_video" not in self.graphs:
                raise ValueError("this export has no vision_video graph (re-export to run videos); images take "
                                 "uint8 pixel_frames (see infer/preprocess.py)")
            return _np(self.graphs["vision_video"](pixels.astype(np.float32), *[meta[k] for k in VISION_META])[0])
        return _np(self.graphs["vision"](pixels.astype(np.uint8), *[meta[k] for k in VISION_META])[0])

    def new_cache(self, batch: int, length: int):
        shape = [batch if i == 1 else length if i == 3 else n for i, n in enumerate(self.cache_shape)]
        z = np.zeros(shape, np.dtype(self.spec.cache_dtype))
        return z, z.copy()

    def prefill(self, arrays, cache):
        out = self.graphs["prefill"](*[arrays[k] for k in PREFILL_NAMES], *cache)
        return _np(out[0]), (out[1], out[2])

    def decode(self, arrays, cache):
        out = self.graphs["decode"](*[arrays[k] for k in DECODE_NAMES], *cache)
        return _np(out[0]), (out[1], out[2])


class ExportedRunner:
    """Generation from an export directory; `generate` has the options of infer.generate.generate."""

    def __init__(self, export_dir: str, backend: str = "auto"):
        self.engine = Engine(GraphBackend(export_dir, backend))
        self.meta = self.engine.backend.meta

    @property
    def backend_kind(self) -> str:
        return self.engine.backend.kind

    def generate(self, samples: Sequence[Dict], max_new_tokens: int = 32, padding_side: str = "left",
                 decode=None, on_token=None, **sampling) -> List[List[int]]:
        cfg = SamplingConfig(max_new_tokens=max_new_tokens, **sampling)
        return self.engine.generate(samples, cfg, padding_side, decode, on_token)
