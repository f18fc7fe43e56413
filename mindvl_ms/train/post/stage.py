"""DPO and GRPO stages inside the trainer (`stage.type: dpo | grpo`, dispatched from trainer.py).

The trainer keeps what every stage shares (trainable selection, LR schedule, checkpoints with exact
resume, the non-finite skip, metrics JSONL, progress bar, plots, msrun data parallel); a step driver
here does the per-step work: `driver.step(step, lr) -> (StepResult, extra metrics)`, with its
`engine` (a PostTrainStep) and its `source` (train/post/sources.py; resumable: `state_dict` /
`load_state_dict`). `make_step_driver` picks the driver of the stage's type.

GRPO step: this rank samples G responses for each of its prompts with the sampler the trainer was given
(train/post/sampler.py; seeds from the prompt's dataset index and the step, so the global rollouts do
not depend on the rank count), scores them, normalises advantages per group, computes the behaviour
log-probs once, then runs global_batch * G / mini_batch_size optimizer updates over consecutive slices
of the responses.
DPO step: pair rows (chosen and rejected of a pair packed as two segments of one row) then NTP rows,
split into micro-batches, one optimizer update.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from matplotlib.figure import Figure
from mindspore import Tensor

from mindvl_ms.config.base import ConfigError
from mindvl_ms.data.preference import encode_response
from mindvl_ms.train.batches import micro_batches, rank_slice
from mindvl_ms.train.loss import IGNORE
from mindvl_ms.train.post.dpo import DPOObjective, RunningMean, dpo_arrays, response_sums, segment_of_rows
from mindvl_ms.train.post.grpo import GRPOObjective, group_advantages
from mindvl_ms.train.post.rewards import Verifier
from mindvl_ms.train.post.sampler import ResponseSampler, require_sampler, rollout_seed
from mindvl_ms.train.post.step import PostTrainStep, post_train_step


def pack_rows(samples: Sequence[Dict], seq_length: int) -> List[List[Dict]]:
    """Greedy packing in order: a row takes samples while they fit in seq_length tokens."""
    rows, cur, used = [], [], 0
    for s in samples:
        n = int(np.asarray(s["input_ids"]).size)
        if n > seq_length:
            raise ValueError(f"a prompt + response of {n} tokens does not fit seq_length {seq_length}")
        if cur and used + n > seq_length:
            rows.append(cur)
            cur, used = [], 0
        cur.append(s)
        used += n
    return rows + ([cur] if cur else [])


def _swap(params, arrays: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    old = {p.name: p.asnumpy().copy() for p in params}
    for p in params:
        p.set_data(Tensor(arrays[p.name]))
    return old


class StepDriver:
    """The per-step work of a post-training stage; `ctx` holds what the trainer built for the stage."""

    def __init__(self, ctx: Dict[str, Any]):
        self.__dict__.update(ctx)  # run_cfg, stage, dist, model, net, params, names, source, allreduce,
        #                           collate, stage_dir, resuming, sampler

    def _engine(self, objective, temperature: float = 1.0) -> PostTrainStep:
        """The stage's step: the previous post stage's on this network when its graphs fit (step.post_train_step)."""
        c = self.run_cfg.context
        return post_train_step(self.net, self.params, self.names, objective, objective.key, self.stage, self.dist.dp,
                               self.allreduce, c.precision, c.loss_scale_value, c.loss_scale_factor,
                               c.loss_scale_window, temperature=temperature)

    def _stage_file(self, name: str, compute: Callable[[], Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
        """Arrays fixed at the stage's start (reference log-probs / weights): computed on a fresh stage,
        reloaded when resuming inside it."""
        path = os.path.join(self.stage_dir, name)
        if self.resuming:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"resuming stage '{self.stage.name}' needs {path} (written at the stage's "
                                        "start; the weights have moved since, so it cannot be recomputed)")
            with np.load(path) as z:
                return {k: z[k] for k in z.files}
        out = compute()
        if self.dist.is_main:
            os.makedirs(self.stage_dir, exist_ok=True)
            np.savez(path + ".tmp.npz", **out)
            os.replace(path + ".tmp.npz", path)
        return out


class DPOStepDriver(StepDriver):
    def __init__(self, ctx):
        super().__init__(ctx)
        d = self.stage.dpo
        for i, (c, r) in enumerate(self.source.pairs):
            n = len(c["input_ids"]) + len(r["input_ids"])
            if n > self.stage.seq_length:
                raise ValueError(f"stage '{self.stage.name}': pair {i} needs {n} tokens (chosen and rejected, each "
                                 f"with the prompt, share a row) but seq_length is {self.stage.seq_length}")
        self.engine = self._engine(DPOObjective(d.beta, d.preference_weight, d.quality_weight))
        self.delta = RunningMean()
        self.engine.extra_state = {p.name: p for p in (self.delta.mean, self.delta.count)}
        self.ref = self._stage_file("reference_logps.npz", self._reference)["logps"]  # [n_pairs, 2]

    def _reference(self) -> Dict[str, np.ndarray]:
        """Summed response log-probs of every pair under the starting weights (ranks split the pairs)."""
        n = len(self.source.pairs)
        out = np.zeros((n, 2), np.float32)
        mine = [i for i in range(n) if i % self.dist.world == self.dist.rank]
        for chunk in micro_batches(mine, self.stage.micro_batch_size):
            rows = [list(self.source.pairs[i]) for i in chunk]
            mb = self.collate(rows, self.stage)
            sums = response_sums(self.engine.target_logp(mb), mb["segment_ids"])
            for i, segs in zip(chunk, segment_of_rows(rows)):
                out[i] = sums[segs[0]], sums[segs[1]]
        return {"logps": self.allreduce(out.reshape(-1)).reshape(n, 2)}

    def step(self, step: int, lr: float):
        st, d, dist = self.stage, self.stage.dpo, self.dist
        idx = rank_slice(self.source.main.next_global_batch(st.global_batch_size), dist.rank, dist.dp)
        n_ntp = d.ntp_rows(st.global_batch_size, dist.dp)  # dpo.ntp_ratio rows per pair on every rank
        ntp = (rank_slice(self.source.ntp.next_global_batch(n_ntp), dist.rank, dist.dp)
               if self.source.ntp is not None else [])
        rows = [list(self.source.pairs[i]) for i in idx] + [list(r) for r in ntp]
        kinds = list(idx) + [-1] * len(ntp)
        chunks = [(rows[k:k + st.micro_batch_size], kinds[k:k + st.micro_batch_size])
                  for k in range(0, len(rows), st.micro_batch_size)]
        mbs, counts = [], np.zeros(2, np.float32)
        for r, kd in chunks:
            mb = self.collate(r, st)
            segs, sup = segment_of_rows(r), mb["targets"] != IGNORE
            n_pair = sum(1 for x in kd if x >= 0)
            chosen = [s[0] for s in segs[:n_pair]]
            counts += [(np.isin(mb["segment_ids"], chosen) & sup).sum(),
                       (np.isin(mb["segment_ids"], [x for s in segs[n_pair:] for x in s]) & sup).sum()]
            mbs.append((mb, r, n_pair, [x for x in kd if x >= 0]))
        g = self.allreduce(counts)
        delta = np.float32(self.delta.mean.asnumpy())
        arrays = [self.engine.model_arrays(mb) + dpo_arrays(mb, r, n, self.ref[ix], st.global_batch_size,
                                                            float(g[0]), float(g[1]), d.sft_weight) + [delta]
                  for mb, r, n, ix in mbs]
        res, stats = self.engine.run_arrays(arrays, lr)
        s = self.allreduce(stats.astype(np.float32))
        if res.applied and d.quality_weight:
            self.delta.update(float(s[2] + s[3]) / 2.0)
        return res, {"margin": float(s[0]), "pref_accuracy": float(s[1]), "chosen_reward": float(s[2]),
                     "rejected_reward": float(s[3]), "bco_delta": float(delta)}


def verifier_of(stage) -> Verifier:
    """The reward verifier of a grpo stage; a `grpo.reward` that names no verifier is a ConfigError naming the
    stage and the key (the config checks only the name's form)."""
    g = stage.grpo
    try:
        return Verifier(g.reward, g.accuracy_weight, g.format_weight, g.numeric_rel_tol)
    except ValueError as e:
        raise ConfigError(f"stage '{stage.name}': grpo.reward: {e}") from None


def check_post_stages(stages, sampler: Optional[ResponseSampler]) -> None:
    """Before any stage runs: every grpo stage's reward names a verifier and a sampler was given, so a
    run never trains its first stages and then stops at a later one's typo."""
    for stage in stages:
        if stage.type == "grpo":
            verifier_of(stage)
            require_sampler(stage, sampler)


class GRPOStepDriver(StepDriver):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.sampler = require_sampler(self.stage, ctx.get("sampler"))
        g = self.stage.grpo
        self.engine = self._engine(GRPOObjective(g.clip_low, g.clip_high, g.kl_coef, g.temperature), g.temperature)
        self.verifier = verifier_of(self.stage)
        self.updates = g.updates_per_step(self.stage.global_batch_size)
        self.ref_weights = (self._stage_file("reference_weights.npz",
                                             lambda: {p.name: p.asnumpy().copy() for p in self.params})
                            if g.kl_coef > 0 else None)

    def rollouts(self, step: int, idx: Sequence[int]):
        """Samples (prompt + response, labels on the response), rewards and response lengths."""
        g, src = self.stage.grpo, self.source
        samples, rewards, lengths = [], [], []
        groups = self.sampler.sample(self.model, [src.prompts[i] for i in idx], g.group_size,
                                     [rollout_seed(self.run_cfg.seed, step, i) for i in idx], g.max_new_tokens,
                                     g.temperature, g.top_p, src.eos)
        for i, outs in zip(idx, groups):
            p = src.prompts[i]
            for o in outs:
                text = src.decode(o)  # the verifiers' text: eos dropped, grounding tags kept
                rewards.append(self.verifier(text, p["answer"], p.get("reward") or None))
                lengths.append(len(o))
                samples.append(encode_response(p, o))
        return samples, np.asarray(rewards, np.float64), np.asarray(lengths, np.float64)

    def _update_batches(self, samples: List[Dict], adv: np.ndarray) -> List[List[Dict[str, np.ndarray]]]:
        """The micro-batches of each optimizer update of the step, advantages per token in `_adv`.
        Update u takes the responses whose global index q (prompt position in the global batch x G + k)
        has q % updates == u: the same sets for any number of ranks."""
        st = self.stage
        q = self.dist.rank * len(samples) + np.arange(len(samples))
        updates = []
        for u in range(self.updates):
            sel = np.flatnonzero(q % self.updates == u)
            if not sel.size:
                raise ValueError(f"stage '{st.name}': {len(samples)} responses on this rank cannot fill "
                                 f"{self.updates} mini-batches; raise grpo.mini_batch_size or use fewer ranks")
            mbs, off, sub_adv = [], 0, adv[sel]
            for rows in micro_batches(pack_rows([samples[i] for i in sel], st.seq_length), st.micro_batch_size):
                mb = self.collate(rows, st)
                k = sum(len(r) for r in rows)  # segment ids 1..k follow the samples' order
                a = np.concatenate([[0.0], sub_adv[off:off + k]])
                off += k
                mb["_adv"] = np.where(mb["targets"] != IGNORE, a[mb["segment_ids"]], 0.0).astype(np.float32)
                mbs.append(mb)
            updates.append(mbs)
        return updates

    def _fixed_logps(self, updates: List[List[Dict[str, np.ndarray]]]) -> None:
        """Behaviour (`_old`) and reference (`_ref`) log-probs of every micro-batch, before any update."""
        for mbs in updates:
            for mb in mbs:
                mb["_old"] = self.engine.target_logp(mb)
        if self.ref_weights is not None:
            cur = _swap(self.params, self.ref_weights)
            for mbs in updates:
                for mb in mbs:
                    mb["_ref"] = self.engine.target_logp(mb)
            _swap(self.params, cur)

    def _optimize(self, updates: List[List[Dict[str, np.ndarray]]], lr: float) -> Tuple[Any, np.ndarray]:
        """One optimizer update per entry of `updates`; the step result and the global stats sums."""
        tot = np.zeros(4, np.float64)
        losses, applied, res = [], [], None
        for mbs in updates:
            n_tok = self.allreduce(np.array([sum((mb["targets"] != IGNORE).sum() for mb in mbs)], np.float32))[0]
            arrays = [self.engine.model_arrays(mb) + [
                mb["targets"].astype(np.int32), mb["_old"], mb.get("_ref", mb["_old"]), mb["_adv"],
                np.float32(n_tok)] for mb in mbs]
            res, stats = self.engine.run_arrays(arrays, lr)
            losses.append(res.loss)
            applied.append(res.applied)
            tot += stats
        res.loss, res.applied = float(np.mean(losses)), all(applied)
        return res, self.allreduce(tot.astype(np.float32)).astype(np.float64)

    def step(self, step: int, lr: float):
        st, dist = self.stage, self.dist
        idx = rank_slice(self.source.main.next_global_batch(st.global_batch_size), dist.rank, dist.dp)
        samples, rewards, lengths = self.rollouts(step, idx)
        updates = self._update_batches(samples, group_advantages(rewards, st.grpo.group_size))
        self._fixed_logps(updates)
        res, tot = self._optimize(updates, lr)
        r = self.allreduce(np.array([rewards.sum(), (rewards ** 2).sum(), rewards.size, lengths.sum()], np.float32))
        mean = r[0] / r[2]
        out = {"reward_mean": float(mean), "reward_std": float(np.sqrt(max(r[1] / r[2] - mean ** 2, 0.0))),
               "clip_frac": float(tot[1] / max(tot[0], 1)), "entropy": float(tot[2] / max(tot[0], 1)),
               "response_length": float(r[3] / r[2]), "updates": self.updates}
        if self.ref_weights is not None:  # without a reference the KL input is the behaviour policy's
            out["kl"] = float(tot[3] / max(tot[0], 1))
        return res, out


def make_step_driver(ctx: Dict[str, Any]) -> StepDriver:
    """The step driver of the stage `ctx['stage']` (dpo or grpo)."""
    return {"dpo": DPOStepDriver, "grpo": GRPOStepDriver}[ctx["stage"].type](ctx)


POST_PLOT_KEYS = {"grpo": ("reward_mean", "clip_frac", "entropy", "response_length"),
                  "dpo": ("margin", "pref_accuracy", "chosen_reward", "rejected_reward")}


def plot_post(records: List[Dict[str, Any]], path: str, kind: str, title: str) -> Optional[str]:
    """The stage's post-training metrics against step, one panel each."""
    keys = [k for k in POST_PLOT_KEYS[kind] if records and k in records[0]]
    if not keys:
        return None
    fig = Figure(figsize=(3.2 * len(keys), 3), dpi=100)  # no pyplot: no global backend, nothing to close
    steps = [r["step"] for r in records]
    for ax, k in zip(np.atleast_1d(fig.subplots(1, len(keys))), keys):
        ax.plot(steps, [r[k] for r in records])
        ax.set_title(k)
        ax.set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path)
    return path
