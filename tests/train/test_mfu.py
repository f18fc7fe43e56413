"""MFU arithmetic and the per-device peak: table entries for Ascend, the measured matmul rate elsewhere."""
import pytest

from mindvl_ms.train.callbacks import PEAK_TFLOPS, device_peak, measure_matmul_peak, soc_version, summarize


def test_summary_arithmetic_by_hand():
    # 2 ranks; this rank logged 3 steps: tokens 100/200/300, patches 40/0/20, step times 0.5/1.0/1.5 s
    recs = [{"step_time": t, "tokens": n, "patches": p, "loss": 1.0 - i / 10, "applied": i != 1}
            for i, (t, n, p) in enumerate([(0.5, 100, 40), (1.0, 200, 0), (1.5, 300, 20)])]
    counts = {"llm": 1000, "vision": 50, "total": 1100}
    s = summarize(recs, counts, peak_flops=2e6, world=2, wall_time=9.0, compile_time=1.0, peak_source="table: x")
    # tokens 600 * 2 ranks = 1200, patches 60 * 2 = 120; FLOPs = 6 * (1000 * 1200 + 50 * 120) = 7,236,000
    # over 3.0 s = 2,412,000 FLOP/s; peak 2e6 per device * 2 devices = 4e6 -> MFU 0.603
    assert s["tokens"] == 1200 and s["tokens_per_s"] == pytest.approx(400.0)
    assert s["model_tflops_per_s"] == pytest.approx(2.412e-6)
    assert s["peak_tflops_per_s"] == pytest.approx(4e-6)
    assert s["mfu"] == pytest.approx(0.603)
    assert s["skipped_steps"] == 1 and s["final_loss"] == pytest.approx(0.8) and s["peak_source"] == "table: x"


def test_ascend_uses_the_table_and_never_measures():
    def boom():
        raise AssertionError("a table entry must not measure")

    flops, src = device_peak("Ascend", "ascend910b", "bfloat16", measure=boom)
    assert flops == 313e12 and src.startswith("table: ") and "910B" in src
    flops, src = device_peak("Ascend", "Ascend910", "float16", measure=boom)
    assert flops == 256e12 and "ascend910" in src.lower()
    assert all(v[0] > 100 for v in PEAK_TFLOPS.values())


def test_cpu_and_unlisted_ascend_are_measured_and_labelled():
    flops, src = device_peak("CPU", "", "float32", measure=lambda: 3.5e10)
    assert flops == 3.5e10 and src.startswith("measured: ") and "35.0 GFLOP/s" in src and "CPU" in src
    flops, src = device_peak("Ascend", "ascend910b", "float32", measure=lambda: 1e14)  # fp32 is not in the table
    assert flops == 1e14 and src.startswith("measured: no table entry for ascend910b float32")
    flops, src = device_peak("CPU", "ascend910b", "bfloat16", measure=lambda: 2e9)  # the table is Ascend only
    assert flops == 2e9 and src.startswith("measured: ")


def test_soc_version_off_ascend_is_empty():
    assert soc_version() == ""  # the tests run on CPU


def test_measured_peak_is_a_real_rate():
    flops, src = device_peak("CPU", "", "float32", measure=lambda: measure_matmul_peak(n=128, repeats=3))
    assert 1e7 < flops < 1e13 and src.startswith("measured: ")
