"""MoE layer benchmark on CPU: forward+backward time against transformers' DeepseekV3MoE, and the
tokens-per-expert balance before/after the aux-loss-free bias update.

    python bench/bench_moe.py [--tokens 512] [--hidden 256] [--experts 8 64] [--topk 4] [--repeats 60]
                              [--dispatch sparse dense grouped] [--threads 1]

Both sides get the same weights and the same input; the reference is measured in the same run, so the
printed ratios (transformers time / ours: speed-up, higher is better) are comparable across machines. Our
layer runs as a compiled MindSpore graph (GRAPH_MODE) with the chosen expert dispatches: "sparse" (the CPU
default, routed rows only: an [E, C] capacity layout, expert-pure row blocks when an expert overflows C;
the branch taken is printed), "dense" (every expert on every token) and "grouped" (the Ascend dataflow
through the CPU equivalents of its fused kernels; slow, E times the expert work).
Timing is interleaved (each repetition runs every side back to back, after warm-up steps) and the median of
the per-repetition ratios is printed with the median times.
Balance: a router whose gate strongly prefers the first experts routes the same tokens for N steps while
`ExpertBiasUpdate` adjusts e_score_correction_bias; max/mean tokens per expert is printed before and after.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def hf_moe(args, experts):
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=args.hidden, moe_intermediate_size=args.inter, n_routed_experts=experts,
                           num_experts_per_tok=args.topk, n_group=args.groups, topk_group=args.topk_groups,
                           n_shared_experts=1, routed_scaling_factor=2.5, vocab_size=32, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(0)
    moe = DeepseekV3MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.05)
    return cfg, moe


def ours_moe(cfg, moe, dispatch):
    from mindspore import Tensor

    from mindvl_ms.config.model import text_from_hf
    from mindvl_ms.models.moe import DeepseekV3MoE

    d = cfg.to_dict()
    d.update(model_type="deepseek_v3")
    tc = text_from_hf(d)
    cell = DeepseekV3MoE(tc, dispatch)
    sd = {k: v.detach().numpy() for k, v in moe.state_dict().items()}
    e = cfg.n_routed_experts
    for name, p in cell.parameters_and_names():
        if name.startswith("experts."):
            proj = name.split(".")[1]
            arr = np.stack([sd[f"experts.{j}.{proj}.weight"].T for j in range(e)])
        else:
            arr = sd[name if name in sd else name + ".weight"]
        p.set_data(Tensor(np.ascontiguousarray(arr, np.float32)))
    return cell


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_speed(args, experts):
    """Interleaved timing: each repetition runs transformers, then each of our dispatches back to back, so a
    load change on a shared machine hits all sides; the median of per-repetition ratios is reported with the
    median times. Returns {dispatch: speed-up}."""
    import mindspore as ms
    import torch
    from mindspore import Tensor, nn

    cfg, moe = hf_moe(args, experts)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, args.tokens // 2, args.hidden)).astype(np.float32)
    g = rng.standard_normal(x.shape).astype(np.float32)
    xt, gt = torch.tensor(x, requires_grad=True), torch.tensor(g)

    def hf_step():
        moe.zero_grad()
        xt.grad = None
        out = moe(xt)
        (out * gt).sum().backward()
        return out

    ref_out = hf_step().detach().numpy()
    valid = Tensor(np.ones(args.tokens, np.float32))
    xs, gs = Tensor(x), Tensor(g)
    steps, errs = {}, {}

    class Objective(nn.Cell):
        def __init__(self, moe_cell):
            super().__init__()
            self.moe = moe_cell

        def construct(self, x, g, valid):
            y, _, _ = self.moe(x, valid)
            return (y * g).sum()

    for dispatch in args.dispatch:
        cell = ours_moe(cfg, moe, dispatch)
        if dispatch == "sparse":
            from mindvl_ms.ops.moe import expert_capacity

            idx = cell.gate(Tensor(x.reshape(-1, x.shape[-1])))[0].asnumpy()
            top = np.bincount(idx.reshape(-1), minlength=experts).max()
            cap = expert_capacity(idx.size, experts)
            branch = "capacity layout" if top <= cap else "block layout (capacity overflow)"
            print(f"  sparse: at most {top} copies per expert (mean {idx.size / experts:.0f}), capacity {cap}: "
                  f"{branch}")
        obj = Objective(cell)
        grad_fn = ms.jit(ms.value_and_grad(obj, 0, obj.trainable_params()))
        errs[dispatch] = np.abs(cell(xs, valid)[0].asnumpy() - ref_out).max()
        steps[dispatch] = (lambda f: lambda: f(xs, gs, valid)[0].asnumpy())(grad_fn)
        steps[dispatch]()  # compile
    for _ in range(args.warmup):
        hf_step()
        for dispatch in args.dispatch:
            steps[dispatch]()
    times = {"hf": [], **{dispatch: [] for dispatch in args.dispatch}}
    for _ in range(args.repeats):
        times["hf"].append(timed(hf_step))
        for dispatch in args.dispatch:
            times[dispatch].append(timed(steps[dispatch]))
    t_hf = statistics.median(times["hf"])
    print(f"MoE layer fwd+bwd, {args.tokens} tokens, hidden {args.hidden}, {experts} experts top-{args.topk} "
          f"({cfg.n_group} groups, top-{cfg.topk_group}), expert FFN {args.inter}, median of {args.repeats}:")
    print(f"  transformers DeepseekV3MoE        {t_hf * 1e3:8.2f} ms  ({torch.get_num_threads()} thread(s) each side)")
    speedups = {}
    for dispatch in args.dispatch:
        speedups[dispatch] = statistics.median(h / o for o, h in zip(times[dispatch], times["hf"]))
        print(f"  mindvl-ms DeepseekV3MoE {dispatch:8s}  {statistics.median(times[dispatch]) * 1e3:8.2f} ms  "
              f"speed-up transformers/ours {speedups[dispatch]:5.2f}  (forward max |diff| {errs[dispatch]:.2e})")
    return speedups


def bench_balance(args):
    from mindspore import Tensor, nn

    from mindvl_ms.config.model import MoEConfig
    from mindvl_ms.models.moe_router import ExpertBiasUpdate, TopkRouter, expert_load, load_stats

    moe = MoEConfig(n_routed_experts=args.experts[-1], num_experts_per_tok=args.topk, n_group=args.groups,
                    topk_group=args.topk_groups)
    rng = np.random.RandomState(0)
    router = TopkRouter(args.hidden, moe)
    u = rng.randn(args.hidden)
    u /= np.linalg.norm(u)
    skew = np.linspace(2.0, -2.0, moe.n_routed_experts)[:, None] * u[None]
    router.weight.set_data(Tensor((rng.randn(moe.n_routed_experts, args.hidden) * 0.05 + skew).astype(np.float32)))
    x = Tensor((rng.randn(args.tokens, args.hidden) * 0.2 + u).astype(np.float32))
    valid = Tensor(np.ones(args.tokens, np.float32))

    class Step(nn.Cell):
        def __init__(self):
            super().__init__()
            self.router = router
            self.update = ExpertBiasUpdate([router], args.bias_speed)

        def construct(self, x, valid):
            idx, _, _ = self.router(x)
            load = expert_load(idx, self.router.num_experts, valid)[None]
            self.update(load)
            return load

    step = Step()
    loads = [step(x, valid).asnumpy() for _ in range(args.balance_steps)]
    first, last = load_stats(loads[0]), load_stats(loads[-1])
    tail = max(load_stats(l)["max_over_mean"][0] for l in loads[-20:])
    print(f"balance ({args.tokens} tokens, {moe.n_routed_experts} experts, top-{args.topk}, skewed gate, bias step "
          f"{args.bias_speed}):")
    print(f"  before: tokens/expert {[int(v) for v in loads[0][0]]}  max/mean {first['max_over_mean'][0]:.3f}")
    print(f"  after {args.balance_steps} updates: tokens/expert {[int(v) for v in loads[-1][0]]}  "
          f"max/mean {last['max_over_mean'][0]:.3f} (worst of the last 20 steps {tail:.3f})")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=512, help="tokens per step (B=2 rows)")
    p.add_argument("--hidden", type=int, default=256, help="model width")
    p.add_argument("--inter", type=int, default=256, help="expert FFN size")
    p.add_argument("--experts", type=int, nargs="+", default=[8, 64], help="routed experts (one run per value)")
    p.add_argument("--topk", type=int, default=4, help="experts per token")
    p.add_argument("--groups", type=int, default=4, help="expert groups (n_group)")
    p.add_argument("--topk-groups", type=int, default=2, help="groups a token may use (topk_group)")
    p.add_argument("--repeats", type=int, default=60, help="timed repetitions (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of every side before timing")
    p.add_argument("--dispatch", nargs="+", default=["sparse"], choices=["sparse", "dense", "grouped"],
                   help="our expert dispatches to time")
    p.add_argument("--no-balance", action="store_true", help="skip the expert-balance figure")
    p.add_argument("--bias-speed", type=float, default=0.01, help="bias update step for the balance figure")
    p.add_argument("--balance-steps", type=int, default=200, help="bias updates for the balance figure")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for both torch and MindSpore kernels (1: a per-core comparison that stays "
                        "meaningful on a shared machine, where 2-thread torch slows down badly)")
    args = p.parse_args()
    import mindspore as ms
    import torch

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    torch.set_num_threads(args.threads)
    try:
        from mindspore.device_context.cpu.op_tuning import threads_num

        threads_num(args.threads)
    except ImportError:  # older MindSpore
        ms.set_context(runtime_num_threads=args.threads)
    for experts in args.experts:
        bench_speed(args, experts)
    if not args.no_balance:
        bench_balance(args)


if __name__ == "__main__":
    main()
