"""bench/goals.py (where the issues' speed goals stand in a bench_cuda --json run) on small crafted runs."""
import json
import subprocess
import sys
from pathlib import Path

GOALS = Path(__file__).resolve().parents[2] / "bench" / "goals.py"


def report(tmp_path, run):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    out = subprocess.run([sys.executable, str(GOALS), str(path)], check=True, capture_output=True, text=True).stdout
    return out.splitlines()


def attention(config, cache, tokens, heads, copy_fraction, gemm_fraction=0.01, kernel="auto", **more):
    return {"config": config, "cache": cache, "kernel": kernel, "tokens": tokens, "heads": heads, "keys": 2048,
            "us": 1.0, "tflops": 1.0, "gbs": 1.0, "copy_fraction": copy_fraction, "gemm_fraction": gemm_fraction,
            **more}


def line(lines, what):
    (found,) = [x for x in lines if x.endswith(what)]
    return found


def test_goals_are_met_missed_or_absent(tmp_path):
    run = {"device": "test GPU", "ceilings": {"copy_gbs": 1000.0, "gemm_tflops": 100.0, "mma_sync_tflops": 50.0},
           "attention": [attention("glm5-tp8 decode", "fp8_ds_mla", 128, 8, 0.86),
                         attention("dsv32-tp8 decode", "fp8_ds_mla", 128, 16, 0.84),
                         attention("decode (heads)", "fp8_ds_mla", 128, 20, 0.845),
                         attention("glm5-tp8 decode", "fp8_ds_mla", 1, 8, 0.1, graph_us=8.5),
                         attention("dsv4 decode c4", "bfloat16", 128, 64, 0.2, 0.6),
                         attention("dsv4 prefill c4", "bfloat16", 4096, 128, 0.3, 0.8)],
           "topk": [{"tokens": 1, "context": 8192, "graph_us": 4.9, "unsorted_graph_us": 4.0}]}
    lines = report(tmp_path, run)
    assert line(lines, "sparse decode, 8 heads, 128 tokens, fp8_ds_mla").split()[1] == "met"
    assert line(lines, "sparse decode, 16 heads, 128 tokens, fp8_ds_mla").split()[1] == "missed"
    assert line(lines, "sparse decode, 8 heads, 1 token, fp8_ds_mla (graph)").split()[1:3] == ["missed", "8.5"]
    assert line(lines, "top-k 2048 of one 8K row (graph)").split()[1] == "met"
    # 20 heads against the lower of the 8- and 16-head rows (84%), per byte.
    assert "≥ 84.0% of copy" in line(lines, "20 heads, 128 tokens, fp8_ds_mla: per byte as 8/16 heads")
    # Issue 21: nearer cuBLAS than copy, so judged against 57% of cuBLAS.
    v4 = line(lines, "V4 decode c4, 64 heads, 128 tokens, bf16")
    assert v4.split()[1] == "met" and "≥ 57.0% of cuBLAS" in v4
    # A compute-bound prefill against issue 19's prefill goal, 81% of cuBLAS.
    prefill = line(lines, "V4 prefill c4, 128 heads, 4096 tokens, bf16")
    assert prefill.split()[1] == "missed" and "≥ 81.0% of cuBLAS" in prefill
    # A goal the run has no row for is never met.
    assert "not in this run" in line(lines, "dense paged decode, 16 heads, 128 x 8192, bf16")
    assert lines[-1].startswith("5 of ")


def test_later_runs_tables_take_over(tmp_path):
    """Several runs: each table from the last run that holds it, judged against that run's ceilings."""
    ceilings = {"copy_gbs": 1000.0, "gemm_tflops": 100.0, "mma_sync_tflops": 50.0}
    whole = {"device": "test GPU", "ceilings": ceilings,
             "attention": [attention("glm5-tp8 decode", "fp8_ds_mla", 128, 8, 0.86)],
             "topk": [{"tokens": 1, "context": 8192, "graph_us": 9.0, "unsorted_graph_us": 4.0}]}
    later = {"device": "test GPU", "ceilings": {**ceilings, "copy_gbs": 900.0},
             "topk": [{"tokens": 1, "context": 8192, "graph_us": 4.5, "unsorted_graph_us": 6.0}]}
    paths = []
    for name, run in (("whole.json", whole), ("later.json", later)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(run))
    lines = subprocess.run([sys.executable, str(GOALS), *map(str, paths)], check=True, capture_output=True,
                           text=True).stdout.splitlines()
    assert line(lines, "sparse decode, 8 heads, 128 tokens, fp8_ds_mla").split()[1] == "met"  # the whole run's
    assert line(lines, "top-k 2048 of one 8K row (graph)").split()[1:3] == ["met", "4.5"]  # the later run's
    assert line(lines, "top-k 2048 of one 8K row, unsorted (graph)").split()[1:3] == ["missed", "6.0"]
    assert "(whole.json: attention" in lines[0] and "(later.json: topk)" in lines[0]
