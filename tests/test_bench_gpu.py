"""benchmarks/bench_gpu.py on the CPU with the tiny preset, so the GPU benchmark cannot rot
between the runs on a lent GPU (benchmarks/gpu_check.sh)."""

import importlib.util
import json
import math
from pathlib import Path

from crowdtrain.model import DalleTransformer, get_preset
from crowdtrain.model.info import model_info

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_gpu_runs_on_cpu_with_the_tiny_preset_and_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "bench_gpu.json"
    load_bench().main(["--preset", "tiny", "--device", "cpu", "--batch-sizes", "2", "--steps", "1", "--warmup", "0",
                       "--samples", "2", "--peak-tflops", "0.5", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["device"].startswith("cpu") and result["device_type"] == "cpu" and result["precision"] == "fp32"
    flops = 3 * model_info(get_preset("tiny"))["flops_per_token"]["forward"]
    assert result["model_flops_per_token"] == flops and result["seq_len"] == get_preset("tiny").seq_len

    train = [r for r in result["rows"] if r["section"] == "train"]
    # Reversible on and off, sparse and dense attention, each at the one batch size asked for.
    assert {(r["reversible"], r["attention"]) for r in train} == {(a, b) for a in (True, False)
                                                                  for b in ("efficient", "dense")}
    for r in train:
        assert not r["oom"] and r["batch"] == 2 and r["samples_per_s"] > 0 and r["step_s"] > 0
        # MFU is samples/s x seq_len x the preset's model FLOPs per token over the given peak.
        assert math.isclose(r["mfu"], r["samples_per_s"] * result["seq_len"] * flops / 0.5e12, rel_tol=1e-9)
        assert 0 < r["mfu"] < 1
        assert 0 < r["memcalc_gb"]["mixed"] < r["memcalc_gb"]["fp32"]
        # An fp32 run is compared with memcalc's fp32 figure (16-bit autocast runs with `mixed`).
        assert r["vs_memcalc_of"] == "fp32"
        assert r["peak_gb"] > 0 and math.isclose(r["vs_memcalc"], r["peak_gb"] / r["memcalc_gb"]["fp32"] - 1)
    # Reversible layers keep fewer activations, and memcalc says so too.
    by = {(r["reversible"], r["attention"]): r for r in train}
    assert by[True, "dense"]["memcalc_gb"]["fp32"] < by[False, "dense"]["memcalc_gb"]["fp32"]

    (sampling,) = [r for r in result["rows"] if r["section"] == "sampling"]
    assert sampling["samples"] == 2 and sampling["kv_cache"] and sampling["samples_per_s"] > 0
    (offload,) = [r for r in result["rows"] if r["section"] == "offload"]
    assert offload["params"] == sum(p.numel() for p in DalleTransformer(get_preset("tiny")).parameters())
    assert offload["batch"] == 2 and offload["optimizer_s"] > 0 and offload["overlapped_s"] > 0 and isinstance(offload["hidden"], bool)
    printed = capsys.readouterr().out
    assert "samples/s" in printed and "offloaded 8-bit LAMB" in printed


def test_bench_gpu_profile_says_where_one_steps_time_goes(tmp_path, capsys):
    out = tmp_path / "profile.json"
    row = load_bench().main(["--preset", "tiny", "--device", "cpu", "--profile", "2", "--warmup", "0",
                             "--out", str(out)])
    saved = json.loads(out.read_text())["rows"][0]
    assert saved["section"] == "profile" and saved["batch"] == 2 and saved["cpu_s"] > 0
    # A CPU run has no GPU time, hence no launch-bound verdict; the table names the model's ops.
    assert saved["gpu_s"] == 0 and saved["launch_bound"] is False and saved["kernel_launches"] == 0
    assert "aten::" in saved["tables"]["self_cpu_time_total"] and row["cpu_s"] == saved["cpu_s"]
    assert "aten::" in capsys.readouterr().out
