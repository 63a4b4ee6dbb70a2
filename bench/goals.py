#!/usr/bin/env python3
"""Where the open issues' speed goals stand in `bench_cuda --json` runs.

    python3 bench/goals.py [RESULTS.json ...] [--markdown]

Several runs: each table (attention, topk, dsa_decode_step) is read from the last run that holds it, with that run's
ceilings (e.g. a whole run, then a later run of `bench_cuda topk step --json` parts only).

Each goal is a row of the run (picked by its fields) and a target: a fraction of a ceiling measured in the same run
(copy bandwidth, cuBLAS, the mma.sync peak) or a time in µs. A goal whose row the run does not hold is listed as
"not in this run", never as met. Exit status 0 whatever the outcome: this reports, it does not gate.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, NamedTuple, Optional

DEFAULT = Path(__file__).resolve().parent / "results" / "h200.json"


class Goal(NamedTuple):
    issue: int
    what: str
    table: str            # "attention", "topk" or "dsa_decode_step"
    match: dict           # the row's fields
    measure: Callable[[dict, dict], object]  # (row, ceilings) -> the figure, or (figure, target, unit)
    target: float
    at_most: bool         # True: measured <= target (µs); False: measured >= target (a fraction)
    unit: str             # how the figure reads


def copy(row, _):
    return row["copy_fraction"]


def cublas(row, _):
    return row["gemm_fraction"]


def mma_sync(row, ceilings):
    return row["tflops"] / ceilings["mma_sync_tflops"]


def roofline(row, _):  # the larger of the two: memory-bound rows by copy, compute-bound ones by cuBLAS
    return max(row["copy_fraction"], row["gemm_fraction"])


def field(name: str) -> Callable[[dict, dict], float]:
    return lambda row, _: row[name]


def sparse(config: str, cache: str, tokens: int, heads: int, kernel: str = "auto") -> dict:
    return {"config": config, "cache": cache, "tokens": tokens, "heads": heads, "kernel": kernel}


def goals() -> list[Goal]:
    g: list[Goal] = []
    caches = (("fp8_ds_mla", "fp8_ds_mla"), ("bf16", "bfloat16"))
    # Issue 16: memory-bound sparse MLA for 1-32 heads.
    for name, cache in caches:
        for config, heads in (("glm5-tp8 decode", 8), ("dsv32-tp8 decode", 16)):
            g.append(Goal(16, f"sparse decode, {heads} heads, 128 tokens, {name}", "attention",
                          sparse(config, cache, 128, heads), copy, 0.85, False, "of copy"))
            g.append(Goal(16, f"sparse decode, {heads} heads, 32 tokens, {name}", "attention",
                          sparse(config, cache, 32, heads), copy, 0.70, False, "of copy"))
            g.append(Goal(16, f"sparse decode, {heads} heads, 1 token, {name} (graph)", "attention",
                          sparse(config, cache, 1, heads), field("graph_us"), 8.0, True, "µs"))
        g.append(Goal(16, f"dense paged decode, 16 heads, 128 x 8192, {name}", "attention",
                      sparse("dense paged decode", cache, 128, 16), copy, 0.85, False, "of copy"))
        for heads in (8, 16):
            g.append(Goal(16, f"sparse prefill, 4096 x {heads} heads over 32K, {name}: rows read once", "attention",
                          sparse("prefill 32K", cache, 4096, heads), copy, 1.0, False, "of copy"))
    # Heads 1, 4, 20, 32 no slower per byte than 8 and 16: the lower of those two rows' fractions is the target,
    # so these goals are built from the run itself (heads_goals).
    # Issue 19: compute-bound shapes at FlashMLA's speed (sm_90a) and at 45% of the mma.sync peak elsewhere.
    for name, cache in caches:
        g.append(Goal(19, f"sparse decode, 128 heads, 128 tokens, {name}", "attention",
                      sparse("decode (compute)", cache, 128, 128), cublas, 0.57, False, "of cuBLAS"))
        g.append(Goal(19, f"sparse decode, 128 heads, 128 tokens, {name}, mma.sync (wide) forced", "attention",
                      sparse("decode (compute)", cache, 128, 128, "wide"), mma_sync, 0.45, False, "of mma.sync"))
    for heads in (64, 128):
        g.append(Goal(19, f"sparse prefill, 4096 tokens, {heads} heads, bf16", "attention",
                      sparse("prefill", "bfloat16", 4096, heads), cublas, 0.81, False, "of cuBLAS"))
    g.append(Goal(19, "sparse prefill, 4096 tokens, 128 heads, bf16, mma.sync (wide) forced", "attention",
                  sparse("prefill", "bfloat16", 4096, 128, "wide"), mma_sync, 0.45, False, "of mma.sync"))
    g.append(Goal(19, "dense paged decode, 128 heads, 128 x 8192, bf16", "attention",
                  sparse("dense paged decode", "bfloat16", 128, 128), cublas, 0.83, False, "of cuBLAS"))
    # Issue 21: DeepSeek-V4's shapes, goals as V3.2's (memory-bound rows by copy, compute-bound by cuBLAS as issue
    # 19's decode and prefill): decode with the c4 (top-k) and c128 compressed caches, prefill with c4.
    for name, cache in (("fp8 (584 B)", "fp8_ds_mla_v4"), ("bf16", "bfloat16")):
        for heads in (64, 128):
            for ratio in (4, 128):
                g.append(Goal(21, f"V4 decode c{ratio}, {heads} heads, 128 tokens, {name}", "attention",
                              sparse(f"dsv4 decode c{ratio}", cache, 128, heads), by_bound(0.57), 0.0, False, ""))
            g.append(Goal(21, f"V4 prefill c4, {heads} heads, 4096 tokens, {name}", "attention",
                          sparse("dsv4 prefill c4", cache, 4096, heads), by_bound(0.81), 0.0, False, ""))
    # Issue 23: the DSA decode step for 1-8 tokens, from a CUDA graph.
    for tokens, context, requests, target in ((1, 8192, 1, 8.0), (1, 131072, 1, 15.0), (8, 131072, 8, 25.0),
                                              (8, 131072, 1, 25.0)):
        shared = ", one request" if tokens > 1 and requests == 1 else ""
        g.append(Goal(23, f"step, {tokens} token(s) x {context // 1024}K{shared}", "dsa_decode_step",
                      {"tokens": tokens, "context": context, "requests": requests}, field("step_us"), target, True,
                      "µs"))
        g.append(Goal(23, f"step, {tokens} token(s) x {context // 1024}K{shared}, unsorted", "dsa_decode_step",
                      {"tokens": tokens, "context": context, "requests": requests}, field("step_unsorted_us"),
                      target, True, "µs"))
    for context, target in ((8192, 5.0), (131072, 10.0)):
        g.append(Goal(23, f"top-k 2048 of one {context // 1024}K row (graph)", "topk",
                      {"tokens": 1, "context": context}, field("graph_us"), target, True, "µs"))
        g.append(Goal(23, f"top-k 2048 of one {context // 1024}K row, unsorted (graph)", "topk",
                      {"tokens": 1, "context": context}, field("unsorted_graph_us"), target, True, "µs"))
    g.append(Goal(23, "attention alone, 1 token, 8 heads, fp8_ds_mla (graph)", "attention",
                  sparse("glm5-tp8 decode", "fp8_ds_mla", 1, 8), field("graph_us"), 5.0, True, "µs"))
    return g


def by_bound(compute: float) -> Callable[[dict, dict], tuple]:
    """Issue 21's goal for a row: 85% of copy where it is memory-bound, `compute` of cuBLAS where compute-bound (the
    bound: the ceiling the row is nearer). The measure returns (figure, target, unit)."""
    def measure(row, _):
        if row["copy_fraction"] >= row["gemm_fraction"]:
            return row["copy_fraction"], 0.85, "of copy"
        return row["gemm_fraction"], compute, "of cuBLAS"
    return measure


def find(run: dict, table: str, match: dict) -> Optional[dict]:
    rows = [r for r in run.get(table, []) if all(r.get(k) == v for k, v in match.items())]
    return rows[0] if rows else None


def heads_goals(run: dict) -> list[Goal]:
    """Issue 16: 128 tokens at 1, 4, 20 and 32 heads no slower per byte than at 8 and 16 (the lower of the two)."""
    g = []
    for name, cache in (("fp8_ds_mla", "fp8_ds_mla"), ("bf16", "bfloat16")):
        refs = [find(run, "attention", sparse(c, cache, 128, h)) for c, h in (("glm5-tp8 decode", 8),
                                                                             ("dsv32-tp8 decode", 16))]
        if any(r is None for r in refs):
            continue
        floor = min(r["copy_fraction"] for r in refs)
        for heads in (1, 4, 20, 32):
            g.append(Goal(16, f"sparse decode, {heads} heads, 128 tokens, {name}: per byte as 8/16 heads",
                          "attention", sparse("decode (heads)", cache, 128, heads), copy, floor, False, "of copy"))
    return g


TABLES = ("attention", "topk", "dsa_decode_step")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="*", default=[str(DEFAULT)],
                    help=f"bench_cuda --json files, later ones' tables over earlier ones' (default {DEFAULT})")
    ap.add_argument("--markdown", action="store_true", help="a Markdown table (for docs/performance.md)")
    args = ap.parse_args()
    runs = [(Path(path), json.loads(Path(path).read_text())) for path in args.results]
    # Each table from the last run that holds rows of it (the first run where none does).
    source = {t: next((run for run in reversed(runs) if run[1].get(t)), runs[0]) for t in TABLES}
    rows = []
    for goal in sorted(goals() + heads_goals(source["attention"][1]), key=lambda goal: goal.issue):
        run = source[goal.table][1]
        row = find(run, goal.table, goal.match)
        if row is None:
            rows.append((goal, None, "not in this run"))
            continue
        value = goal.measure(row, run["ceilings"])
        if isinstance(value, tuple):  # the target depends on the row (by_bound)
            value, target, unit = value
            goal = goal._replace(target=target, unit=unit)
        met = value <= goal.target if goal.at_most else value >= goal.target
        rows.append((goal, value, "met" if met else "missed"))

    def figure(goal: Goal, value: Optional[float]) -> tuple[str, str]:
        if goal.unit == "µs":
            return f"≤ {goal.target:g} µs", "" if value is None else f"{value:.1f} µs"
        pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
        return f"≥ {pct(goal.target)} {goal.unit}", "" if value is None else f"{pct(value)} {goal.unit}"

    def described(path: Path, run: dict) -> str:
        c = run["ceilings"]
        tables = [t for t in TABLES if source[t][0] == path] if len(runs) > 1 else []
        return (f"copy {c.get('copy_gbs')} GB/s, cuBLAS {c.get('gemm_tflops')} TFLOP/s, mma.sync "
                f"{c.get('mma_sync_tflops')} TFLOP/s ({path.resolve().name}{': ' + ', '.join(tables) if tables else ''})")

    used = [(path, run) for path, run in runs if len(runs) == 1 or any(source[t][0] == path for t in TABLES)]
    head = f"{runs[-1][1].get('device', '?')}: " + "; ".join(described(path, run) for path, run in used)
    met = sum(status == "met" for _, _, status in rows)
    if args.markdown:
        print(f"{head}; {met} of {len(rows)} goals met.\n")
        print("| issue | goal | target | measured | |")
        print("|---:|---|---:|---:|---|")
        for goal, value, status in rows:
            target, measured = figure(goal, value)
            print(f"| {goal.issue} | {goal.what} | {target} | {measured} | {status} |")
    else:
        print(head)
        for goal, value, status in rows:
            target, measured = figure(goal, value)
            print(f"#{goal.issue:<3} {status:<15} {measured:>18}  {target:<22} {goal.what}")
        print(f"{met} of {len(rows)} goals met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
