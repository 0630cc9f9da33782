#!/usr/bin/env bash
# The whole test suite on a GPU machine, one file at a time, so that every file's summary (and
# its failures, one line each) is printed even when a later file runs long. On the H200 with
# 16 CPU cores the suite is compile-bound: up to 14 xdist workers compile in parallel (2 cores
# left for the GPU's host threads), so budget per file.
#   bash tests/run_gpu_suite.sh              # logs and JUnit XML under $OUT (or /tmp/onegemm-gpu)
#   SECONDS_PER_FILE=200 bash tests/run_gpu_suite.sh tests/test_core.py
set -u
python3 -c 'import xdist' 2>/dev/null || { echo 'needs pytest-xdist: pip install -e ".[test]"'; exit 2; }
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/onegemm-gpu}"
mkdir -p "$out"
per_file="${SECONDS_PER_FILE:-360}"  # test_blockscaled.py compiles longest: 231 s cold with 14 workers
# Workers share one GPU's memory: the real-size MoE tests hold several GiB each, and 12 of them
# ran out of an H100's 80 GiB. One per 8 GiB, at most 14 (the H200: 14, an H100: 9); WORKERS overrides.
gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
workers="${WORKERS:-$(( ${gib:-0} / 8192 > 14 ? 14 : (${gib:-0} / 8192 < 1 ? 1 : ${gib:-0} / 8192) ))}"
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(tests/test_*.py)  # every test file: a new one runs without editing this
status=0
for f in "${files[@]}"; do
    name=$(basename "$f" .py)
    timeout "$per_file" python3 -m pytest -q -n "$workers" -p no:cacheprovider -p no:benchmark --tb=line -rfE \
        --junitxml="$out/$name.xml" "$f" > "$out/$name.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || status=1
    echo "== $f: rc=$rc ($( [ $rc -eq 124 ] && echo "stopped at ${per_file}s" || tail -n 1 "$out/$name.log"))"
    grep -E "^(FAILED|ERROR) " "$out/$name.log" | head -n 20
done
exit $status
