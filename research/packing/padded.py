"""The padding arm of experiment (d): `run_training` on the same config with one sample per row.

    python research/packing/padded.py --config research/packing/train.yaml --data MIX.jsonl --out DIR [--set K=V]

The trainer has no padding mode (its data pipeline always packs), so this feeds it rows of a single
sample through its `data_factory` hook (a `train.batches.RowSource`, as `mindvl demo` does), decoding images
per batch in the collate and padding every row to the stage's seq_length with the default collate
(`data.collate.build_model_inputs(..., pad_to=seq_length)`), exactly as the packed modes are padded.
"""
import argparse
import logging


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import mindspore as ms

    from mindvl_ms.config.base import deep_merge, load, to_dict
    from mindvl_ms.config.train import DataConfig, load_run_config
    from mindvl_ms.data.processor import MindVLProcessor
    from mindvl_ms.data.schema import SampleError, iter_jsonl
    from mindvl_ms.data.collate import build_model_inputs
    from mindvl_ms.train import run_training
    from mindvl_ms.train.batches import RowSource

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    cfg = load_run_config(args.config, [f"data.sources=[{{path: {args.data}}}]", *args.set])
    state = {}

    def factory(run_cfg, stage, stage_index, dist):
        data_cfg = load(DataConfig, deep_merge(to_dict(run_cfg.data), stage.data), source="padded")
        state["proc"] = MindVLProcessor(config=data_cfg)
        samples = [s for _, s in iter_jsonl(args.data) if not isinstance(s, SampleError)]
        return RowSource([[s] for s in samples], seed=run_cfg.seed + stage_index, shuffle=data_cfg.shuffle)

    def collate(rows, stage):
        done = [[state["proc"].process_sample(s) for s in row] for row in rows]
        return build_model_inputs(done, cfg.model, pad_to=stage.seq_length)

    run_training(cfg, args.out, data_factory=factory, collate=collate, progress=False)


if __name__ == "__main__":
    main()
