"""DeepSeek-V3 Hugging Face key layout <-> the native layout of `mindvl_ms.models.moe` (bit-exact both ways).

Everything keeps its HF name except:
- routed experts: HF `model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight` ([out, in] per expert)
  <-> native `model.layers.{i}.mlp.experts.{gate,up,down}_proj` stacked over experts and input-major
  ([E, in, out], the GroupedMatmul layout): a stack of transposes, so values are copied unchanged;
- multi-token prediction: HF/DeepSeek `model.layers.{L + k}.*` (L = num_hidden_layers) <-> native
  `model.mtp.{k}.*`. The per-layer copies `embed_tokens.weight` and `shared_head.head.weight` that DeepSeek
  stores with each MTP layer are shared with the main model natively: they are dropped on import (after a
  check that they equal the main model's) and written back from `model.embed_tokens.weight` /
  `lm_head.weight` on export.
Works on plain dicts {name: tensor} whose values have `.data` (numpy) and `.dtype` (safetensors tag), i.e.
`mindvl_ms.checkpoint.io.RawTensor`; names may carry a prefix before `model.` (left untouched).
FP8 block-quantised checkpoints (`*.weight_scale_inv`) must be dequantised first.
"""
import re
from typing import Dict

import numpy as np

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^(.*model\.)layers\.(\d+)\.(.*)$")
_MTP = re.compile(r"^(.*model\.)mtp\.(\d+)\.(.*)$")
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


def _raw(t, data: np.ndarray):
    return type(t)(np.ascontiguousarray(data), t.dtype)


def hf_to_native(tensors: Dict[str, object], text_config) -> Dict[str, object]:
    """HF DeepSeek-V3 names -> native names (see module docstring); raises ValueError on gaps."""
    n_layers = text_config.num_hidden_layers
    n_experts = text_config.moe.n_routed_experts
    quant = [k for k in tensors if k.endswith("weight_scale_inv")]
    if quant:
        raise ValueError(f"FP8 block-quantised DeepSeek checkpoint ({quant[0]} ...): dequantise to bf16/fp32 first")
    out, experts, mtp_copies = {}, {}, {}
    for name, t in tensors.items():
        m = _EXPERT.match(name)
        if m:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
            continue
        m = _LAYER.match(name)
        if m and int(m.group(2)) >= n_layers:
            k = int(m.group(2)) - n_layers
            if m.group(3) in _MTP_SHARED:
                mtp_copies[name] = (m.group(1), m.group(3), t)
                continue
            name = f"{m.group(1)}mtp.{k}.{m.group(3)}"
        out[name] = t
    for (prefix, proj), per in experts.items():
        missing = sorted(set(range(n_experts)) - set(per))
        extra = sorted(set(per) - set(range(n_experts)))
        if missing or extra:
            raise ValueError(f"{prefix}: expected experts 0..{n_experts - 1} for {proj}, missing {missing[:10]}, "
                             f"unexpected {extra[:10]}")
        stacked = np.stack([per[j].data.T for j in range(n_experts)])  # [E, in, out]
        out[f"{prefix}.{proj}"] = _raw(per[0], stacked)
    for name, (prefix, what, t) in mtp_copies.items():
        main = out.get(prefix + "embed_tokens.weight" if what == "embed_tokens.weight" else
                       prefix[: -len("model.")] + "lm_head.weight")
        if main is not None and not np.array_equal(main.data, t.data):
            raise ValueError(f"{name}: differs from the main model's weight; native MTP layers share "
                             f"embed_tokens and lm_head")
    return out


def native_to_hf(tensors: Dict[str, object], text_config) -> Dict[str, object]:
    """Native names -> HF DeepSeek-V3 names (inverse of hf_to_native)."""
    n_layers = text_config.num_hidden_layers
    out = {}
    mtp_prefixes = {}
    for name, t in tensors.items():
        if name.endswith((".mlp.experts.gate_proj", ".mlp.experts.up_proj", ".mlp.experts.down_proj")):
            prefix, proj = name.rsplit(".", 1)
            if t.data.ndim != 3:
                raise ValueError(f"{name}: expected stacked expert weights [E, in, out], got shape {t.data.shape}")
            for j in range(t.data.shape[0]):
                out[f"{prefix}.{j}.{proj}.weight"] = _raw(t, t.data[j].T)
            continue
        m = _MTP.match(name)
        if m:
            layer = n_layers + int(m.group(2))
            mtp_prefixes[layer] = m.group(1)
            name = f"{m.group(1)}layers.{layer}.{m.group(3)}"
        out[name] = t
    for layer, prefix in sorted(mtp_prefixes.items()):
        emb = tensors.get(prefix + "embed_tokens.weight")
        head = tensors.get(prefix[: -len("model.")] + "lm_head.weight")
        if emb is not None:
            out[f"{prefix}layers.{layer}.embed_tokens.weight"] = emb
        if head is not None:
            out[f"{prefix}layers.{layer}.shared_head.head.weight"] = head
    return out
