#!/usr/bin/env bash
# expect.sh CODE SUBSTRING -- COMMAND...: runs COMMAND, fails unless it exits
# with CODE and its stdout+stderr contain SUBSTRING (empty: anything).
set -u
code=$1 want=$2
shift 3
out=$("$@" 2>&1)
rc=$?
printf '%s\n' "$out"
if [ "$rc" != "$code" ]; then echo "expect.sh: exit status $rc, expected $code" >&2; exit 1; fi
if [ -n "$want" ] && [[ "$out" != *"$want"* ]]; then echo "expect.sh: output lacks: $want" >&2; exit 1; fi
n=$(printf '%s\n' "$out" | grep -c 'terminate called\|Segmentation\|AddressSanitizer\|runtime error')
if [ "$n" != 0 ]; then echo "expect.sh: crash or sanitizer report" >&2; exit 1; fi
