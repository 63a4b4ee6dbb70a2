#!/usr/bin/env bash
# Runs bench_cuda rows of two builds in one GPU session, one row of each build in turn, so that both see the same
# clocks and the same neighbours; prints each build's row line, then a table of µs (and µs from a CUDA graph, where
# the row has it) with B's change against A.
#
#   scripts/bench-ab.sh A_DIR B_DIR 'ROW ARGS' ['ROW ARGS' ...]
#   e.g. scripts/bench-ab.sh .gpu/old .gpu/new 'sparse 1 8 2048 fp8' 'sparse 128 128 2048 fp8 wgmma'
#
# A_DIR and B_DIR hold a bench_cuda (and lib/ for its OpenBLAS), as scripts/pack-gpu-binaries.sh packs them. Each
# row's arguments are bench_cuda's for one config (docs/gpu-testing.md). Each invocation measures its ceilings first:
# the row lines' fractions are against those.
set -uo pipefail
[[ $# -ge 3 ]] || { echo "usage: $0 A_DIR B_DIR 'ROW ARGS' ['ROW ARGS' ...]" >&2; exit 2; }
a=$1 b=$2
shift 2
for d in "$a" "$b"; do
  [[ -x "$d/bench_cuda" ]] || { echo "$0: no bench_cuda in $d" >&2; exit 1; }
done

# One row of one build: the ceilings its invocation measured ("ceilings measured now: ...", to stderr) and its row
# line (cache format as bench_cuda prints it: bfloat16, float16, fp8_ds_mla...; kernel, then tokens, heads and keys),
# or "(no row)".
row_line() {
  local dir=$1 args=$2 out
  # shellcheck disable=SC2086  # the row's arguments are words
  out=$(LD_LIBRARY_PATH="$dir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout 120 "$dir/bench_cuda" $args 2>&1)
  grep -m1 'ceilings measured now' <<<"$out" >&2
  grep -E ' (bfloat16|float16|fp8_ds_mla[a-z0-9_]*) +[a-z][a-z0-9/-]* +[0-9]+ +[0-9]+ +[0-9]+ ' <<<"$out" | tail -1 | grep . ||
    echo "(no row)"
}
# µs of a row line: the field three before its fraction ("33%"); and its graph µs ("graph 7.8 us"), or "-".
us_of() { awk '{for (i = 1; i <= NF; ++i) if ($i ~ /^[0-9]+%$/) {print $(i - 3); exit}}' <<<"$1"; }
graph_of() { awk '{for (i = 1; i < NF; ++i) if ($i == "graph") {print $(i + 1); exit} print "-"}' <<<"$1"; }
change() { awk -v x="$1" -v y="$2" 'BEGIN {if (x > 0 && y != "" && y != "-") printf "%+.1f%%", 100 * (y - x) / x; else print "-"}'; }

table=()
for args in "$@"; do
  la=$(row_line "$a" "$args")
  lb=$(row_line "$b" "$args")
  echo "A $la"
  echo "B $lb"
  ua=$(us_of "$la") ub=$(us_of "$lb") ga=$(graph_of "$la") gb=$(graph_of "$lb")
  table+=("$(printf '| %s | %s | %s | %s | %s | %s | %s |' "$args" "${ua:--}" "${ub:--}" "$(change "${ua:-0}" "$ub")" \
    "$ga" "$gb" "$(change "${ga/-/0}" "$gb")")")
done
echo
echo "A: $a   B: $b"
echo "| row | A us | B us | B vs A | A graph us | B graph us | B vs A |"
echo "|---|---:|---:|---:|---:|---:|---:|"
printf '%s\n' "${table[@]}"
