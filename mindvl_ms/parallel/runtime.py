"""Distribution: msrun data parallel on CPU/Ascend, auto-parallel context on Ascend, strategy checks.

- Launch with `scripts/msrun_train.sh N mindvl train --config ...` (msrun starts N workers and a
  scheduler; `mindspore.communication.init()` joins them: mccl on CPU, hccl on Ascend).
- Rank coordinates come from `mindvl_ms.parallel.Layout`: `DistInfo` carries the layout and this
  rank's (pp, dp, tp) indices; data loaders read by `dp_rank` (the ranks of one tensor-parallel group
  read the same rows), not by the global rank.
- Data parallel (parallel_mode 0) is explicit: every rank runs the same compiled micro-step graph on its
  rows, and the apply graph all-reduces (sums) the accumulated gradients once per global batch
  (`DistInfo.explicit_grad_reduce`). The loss is normalised by global counts, so the sum equals the
  single-process gradient of the same global batch. Under semi-auto / auto parallel
  (`DistInfo.semi_auto`) the compiler inserts the gradient reduction for the global-semantics graph,
  so `explicit_grad_reduce` is false (`compiler_reduces` true) and the step must not add its own.
  `parallel.gradients_mean` goes to the auto-parallel context (false: the loss is normalised by global
  counts, so the summed gradient is the single-process one).
- On Ascend the `parallel:` / `parallel_config:` sections go to `set_auto_parallel_context`
  (parallel mode, device_num, pipeline stages, parallel optimizer, search mode), and
  `context.jit_level` to `set_context(jit_config=...)`. On CPU anything beyond data parallel is refused
  with a clear message.
- On Ascend the overlap switches of `context.parallel_speed_up` (MindSpore's own key names) go to
  `set_context(ascend_config={"parallel_speed_up_json_path": FILE})`, FILE a JSON of those keys written here
  (MindSpore reads them from a file only); the file stays until the process exits, as the context names it.
- `validate_strategy` checks divisibility (heads, KV heads, hidden, FFN, vocab, layers, experts)
  before any graph is built; on Ascend `parallel/validate.py` then refuses a semi/auto run whose loader,
  `dataset_strategy` or micro-batch count does not match.
- Started by scripts/msrun_train.sh, the workers and the scheduler die with msrun (`end_with_launcher`), so
  a killed launcher leaves no process behind; a worker that dies is handled by msrun and the scheduler
  (README, "Data parallel and worker failures").
"""
from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import signal
import sys
import tempfile
from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops
from mindspore.communication import GlobalComm, get_group_size, get_rank, init

from mindvl_ms.config.base import ConfigError
from mindvl_ms.data.collate import INPUT_NAMES, INPUT_RANKS, VISION_NAMES
from mindvl_ms.parallel.layout import Layout
from mindvl_ms.parallel.moe_validate import validate_moe_parallel
from mindvl_ms.parallel.validate import validate_parallel

log = logging.getLogger(__name__)


@dataclass
class DistInfo:
    """This process in the run: global rank, world size, data-parallel size and its coordinates."""

    rank: int = 0
    world: int = 1
    dp: int = 1                       # data-parallel size (loaders split the global batch this many ways)
    dp_rank: int = 0                  # data-parallel index: what the loader reads by
    tp_rank: int = 0
    pp_rank: int = 0
    layout: Optional[Layout] = None
    semi_auto: bool = False           # semi_auto / auto parallel on Ascend: the compiler reduces gradients
    explicit_grad_reduce: bool = False  # the train step all-reduces gradients itself (data parallel, world > 1)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def compiler_reduces(self) -> bool:
        """MindSpore inserts the gradient reduction (semi/auto parallel on more than one rank)."""
        return self.semi_auto and self.world > 1


def context_settings(ctx) -> dict:
    """`ms.set_context` keywords of the `context:` section (besides mode and device)."""
    kw = {}
    if ctx.device_target == "Ascend":
        kw["jit_config"] = {"jit_level": ctx.jit_level}
        if ctx.max_device_memory:
            kw["max_device_memory"] = ctx.max_device_memory
    return kw


def parallel_speed_up(ctx) -> dict:
    """MindSpore's parallel speed-up JSON (key -> value) of `context.parallel_speed_up` on Ascend; {} when every
    switch is off (MindSpore's defaults) or the device is not Ascend (set_context ignores ascend_config there)."""
    switches = asdict(ctx.parallel_speed_up)
    return switches if ctx.device_target == "Ascend" and any(switches.values()) else {}


def apply_parallel_speed_up(ctx) -> str:
    """Write `parallel_speed_up(ctx)` to a JSON file and hand it to `set_context(ascend_config=...)`; returns
    the file ('' when there is nothing to set). Removed at exit."""
    switches = parallel_speed_up(ctx)
    if not switches:
        return ""
    fd, path = tempfile.mkstemp(prefix="parallel_speed_up_", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(switches, f)
    atexit.register(os.remove, path)
    ms.set_context(ascend_config={"parallel_speed_up_json_path": path})
    return path


SUPERVISED_GRIDS = 4  # the sparse head's row-local [B, n, c] inputs (train.loss_head.supervised_layout)


def dataset_strategy(dp: int, vision_ranks: int = 1) -> Tuple[Tuple[int, ...], ...]:
    """The `dataset_strategy` of the semi/auto-parallel train step's inputs, in their order: the model
    inputs (data.collate INPUT_NAMES), then the sparse head's four grids (the step's scalars are Parameters,
    train/mf_step.py). Every array carries the rows first (a rank's micro-batches concatenated on them) with
    row-local indices (data.collate's contract), so it is split dp ways on the row dimension and whole on
    every other: the TP and pipeline peers of a data-parallel rank read the same rows, which is what each
    rank's loader hands it. With `vision_ranks` > 1 (`ParallelConfig.vision_ranks`) the ViT's inputs
    (VISION_NAMES) carry each rank's own share of its group's images instead (`parallel.vit_balance`): one
    "row" per rank, split over all dp * vision_ranks ranks of a stage."""
    ranks = [INPUT_RANKS[name] for name in INPUT_NAMES] + [3] * SUPERVISED_GRIDS
    split = [dp * vision_ranks if name in VISION_NAMES else dp for name in INPUT_NAMES] + [dp] * SUPERVISED_GRIDS
    return tuple((n,) + (1,) * (r - 1) for n, r in zip(split, ranks))


def auto_parallel_settings(run_cfg, world: int) -> dict:
    """`ms.set_auto_parallel_context` keywords for an Ascend run of `world` ranks. Under semi/auto parallel
    every rank loads its own rows (`full_batch` false) and the graph learns which by `dataset_strategy`."""
    sizes, par = run_cfg.parallel_config, run_cfg.parallel
    modes = {0: "data_parallel", 1: "semi_auto_parallel", 2: "auto_parallel", 3: "hybrid_parallel"}
    kw = dict(parallel_mode=modes[par.parallel_mode], device_num=world, gradients_mean=par.gradients_mean,
              full_batch=par.full_batch, enable_parallel_optimizer=par.enable_parallel_optimizer)
    if par.parallel_mode in (1, 2):
        kw["full_batch"] = False
        kw["dataset_strategy"] = dataset_strategy(sizes.data_parallel, sizes.vision_ranks)
    if par.parallel_mode == 2:
        kw["search_mode"] = par.search_mode
    if sizes.pipeline_stage > 1:
        kw["pipeline_stages"] = sizes.pipeline_stage
    if par.strategy_ckpt_save_file:
        kw["strategy_ckpt_save_file"] = par.strategy_ckpt_save_file
    return kw


def launched_by_msrun() -> bool:
    return "MS_WORKER_NUM" in os.environ and "MS_ROLE" in os.environ


LAUNCHER_PID = "MINDVL_LAUNCHER_PID"  # set by scripts/msrun_train.sh: the pid msrun runs as (it is exec'd)
PR_SET_PDEATHSIG = 1                  # <linux/prctl.h>


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        pass
    return True


def end_with_launcher() -> bool:
    """Have Linux SIGKILL this process (a worker or the scheduler) when the msrun that started it exits.

    msrun starts each worker in a session of its own and ends the others itself when one fails, but when
    msrun is killed (a signal to the launcher, a test's timeout) they would run on without it. Only under
    scripts/msrun_train.sh (LAUNCHER_PID set): `msrun --join=False` exits while its workers run. A launcher
    already gone when this runs ends the process at once. Returns whether the parent-death signal is set."""
    want = os.environ.get(LAUNCHER_PID, "")
    if not want.isdigit() or not sys.platform.startswith("linux"):
        return False
    launcher, armed = int(want), False
    if os.getppid() == launcher:  # a direct child of msrun (not a process a worker started)
        armed = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    if os.getppid() != launcher and not _alive(launcher):
        raise SystemExit(f"msrun (pid {launcher}) has exited: this process ends too")
    return armed


def validate_strategy(model_cfg, sizes, world: int) -> List[str]:
    """Raise ConfigError listing every divisibility problem of (dp, mp, pp, ep) for this model."""
    mp, pp, ep, dp = sizes.model_parallel, sizes.pipeline_stage, sizes.expert_parallel, sizes.data_parallel
    problems: List[str] = []
    checks = []
    if dp * mp * pp != world:
        problems.append(f"data_parallel ({dp}) x model_parallel ({mp}) x pipeline_stage ({pp}) = {dp * mp * pp}, "
                        f"but {world} ranks are running")
    t, v = model_cfg.text, model_cfg.vision
    checks += [("text num_attention_heads", t.num_attention_heads, mp),
              ("text num_key_value_heads", t.num_key_value_heads, mp),
              ("text hidden_size", t.hidden_size, mp),
              ("text intermediate_size", t.intermediate_size, mp),
              ("vision num_heads", v.num_heads, mp),
              ("vision hidden_size", v.hidden_size, mp)]
    layers = t.num_hidden_layers
    if sizes.offset:
        per = [layers // pp + o for o in sizes.offset]
        if len(sizes.offset) != pp or sum(per) != layers or min(per) < 1:
            problems.append(f"offset {sizes.offset}: needs {pp} entries and layers {layers} = sum(layers // pp + "
                            f"offset[i]) with every stage >= 1 layer (got {per})")
    else:
        checks.append(("text num_hidden_layers", layers, pp))
    if not sizes.vocab_emb_dp:
        checks.append(("text vocab_size", t.vocab_size, mp))
    if t.model_type == "deepseek_v3":
        checks.append(("moe n_routed_experts", t.moe.n_routed_experts, ep))
        if ep * mp > world:
            problems.append(f"expert_parallel ({ep}) x model_parallel ({mp}) exceeds the {world} ranks")
        try:  # the MoE module's own rules (experts / EP / TP divisibility)
            validate_moe_parallel(t, sizes, device_num=world)
        except (ValueError, ConfigError) as e:
            problems.append(str(e))
    elif ep != 1:
        problems.append(f"expert_parallel={ep} but the text model ({t.model_type}) has no experts")
    for name, value, by in checks:
        if by > 1 and value % by:
            problems.append(f"{name} {value} is not divisible by {by}")
    if problems:
        raise ConfigError("parallel strategy does not fit the model:\n  " + "\n  ".join(problems))
    return problems


def set_device(target: str) -> None:
    """`ms.set_device(target)`, keeping the device id `init()` gave this rank when the process has joined its
    cluster already (a worker that trains several runs, each calling `setup`): under msrun `init()` gives rank
    r device id r, and MindSpore refuses a later set_device with another id (the default is 0)."""
    ms.set_device(target, ms.get_context("device_id") if GlobalComm.INITED else None)


def setup(run_cfg) -> DistInfo:
    """Set the MindSpore context, join the msrun cluster when launched by it, validate the strategy."""
    ctx = run_cfg.context
    ms.set_context(mode=ms.GRAPH_MODE if ctx.mode == 0 else ms.PYNATIVE_MODE)
    set_device(ctx.device_target)
    extra = context_settings(ctx)
    if extra:
        ms.set_context(**extra)
    apply_parallel_speed_up(ctx)
    sizes, par = run_cfg.parallel_config, run_cfg.parallel
    cpu = ctx.device_target == "CPU"
    if cpu and (par.parallel_mode != 0 or sizes.model_parallel > 1 or sizes.pipeline_stage > 1
                or sizes.expert_parallel > 1 or par.enable_parallel_optimizer):
        raise ConfigError(
            "on CPU only data parallel is supported: set parallel.parallel_mode: 0, parallel_config."
            "model_parallel/pipeline_stage/expert_parallel: 1 and parallel.enable_parallel_optimizer: false "
            f"(got mode {par.parallel_mode}, mp {sizes.model_parallel}, pp {sizes.pipeline_stage}, "
            f"ep {sizes.expert_parallel}); tensor/pipeline/expert parallel need Ascend")
    info = DistInfo()
    if launched_by_msrun():
        end_with_launcher()
    if launched_by_msrun() or os.environ.get("MS_SIMULATION_LEVEL"):  # dry run: init() mocks the cluster
        init()
        info.rank, info.world = get_rank(), get_group_size()
    if sizes.data_parallel == 1 and sizes.model_parallel * sizes.pipeline_stage == 1 and info.world > 1:
        sizes.data_parallel = info.world
        log.info("parallel_config.data_parallel set to %d (the number of ranks)", info.world)
    validate_strategy(run_cfg.model, sizes, info.world)
    fill_coords(info, run_cfg)
    if not cpu and info.world > 1:
        settings = auto_parallel_settings(run_cfg, info.world)
        validate_parallel(run_cfg, info.world, settings)  # loader, dataset_strategy, micro-batches
        ms.set_auto_parallel_context(**settings)
    return info


def fill_coords(info: DistInfo, run_cfg) -> DistInfo:
    """Set the layout, this rank's coordinates and who reduces gradients (after validate_strategy)."""
    layout = Layout.from_run_config(run_cfg, info.world)
    c = layout.coords(info.rank) if info.rank < layout.world else None
    info.layout, info.dp = layout, layout.dp
    if c is not None:
        info.dp_rank, info.tp_rank, info.pp_rank = c.dp, c.tp, c.pp
    info.semi_auto = run_cfg.context.device_target != "CPU" and run_cfg.parallel.parallel_mode in (1, 2)
    info.explicit_grad_reduce = info.world > 1 and not info.semi_auto
    return info


class _Collective(nn.Cell):
    """One collective primitive (AllReduce, AllGather) as a cell, so it runs as a graph."""

    def __init__(self, op):
        super().__init__()
        self.op = op

    def construct(self, v):
        return self.op(v)


class HostAllReduce:
    """Sum a small float32 numpy vector over the data-parallel replicas (counts used to normalise the loss).

    The all-reduce runs over all `world` ranks; the `world / dp` ranks of one data-parallel replica (its
    tensor- and pipeline-parallel peers) read the same rows, so the world sum is divided by that factor
    (`dp` defaults to `world`: plain data parallel, nothing to divide)."""

    def __init__(self, world: int, dp: int = None):
        self.world = world
        self.replica = world // (dp or world)  # ranks per data-parallel replica (tp * pp)
        self._cell = None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.world == 1:
            return x
        if self._cell is None:
            self._cell = _Collective(ops.AllReduce())
        out = self._cell(Tensor(np.asarray(x, np.float32), ms.float32)).asnumpy()
        return out / self.replica if self.replica > 1 else out


def gather_json(obj, world: int):
    """{"rank<r>": obj of rank r} on every rank (an AllGather of the JSON bytes, padded to equal length)."""
    if world == 1:
        return {"rank0": obj}
    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8).astype(np.int32)
    sizes = HostAllReduce(world)(np.eye(world, dtype=np.float32)[get_rank()] * raw.size).astype(int)
    buf = np.zeros(int(sizes.max()), np.int32)
    buf[:raw.size] = raw
    allv = _Collective(ops.AllGather())(Tensor(buf, ms.int32)).asnumpy().reshape(world, -1)
    return {f"rank{r}": json.loads(bytes(allv[r, :sizes[r]].astype(np.uint8)).decode()) for r in range(world)}

