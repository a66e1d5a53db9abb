#!/usr/bin/env bash
# The test files that take other branches on a GPU, run on a GPU host against an installed jengine
# (`pip install .`, not editable: `python -P` keeps the source tree's `jengine/` off the path), each file in
# a pytest process of its own, since a file's engines keep most of the device for the process's life.
#
#   bash tests/gpu_files.sh LOG_DIR SECONDS [FILE ...]
#
# FILE: test file names (default: those naming the GPU backend). Each file's log goes to LOG_DIR/NAME.log
# and one line per file is printed; files not started SECONDS after the first are reported as not run.
# SHARD=i/n (environment) runs only every n-th test of each file, from the i-th (0-based): a file longer than one
# device call (test_attention_mosaic, ~10 min on an H200) runs over n calls.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ] || ! [[ $2 =~ ^[0-9]+$ ]]; then
  echo "usage: bash tests/gpu_files.sh LOG_DIR SECONDS [FILE ...]  (SECONDS: a whole number)" >&2
  exit 2
fi
out=$1 deadline=$2
shift 2
shard=${SHARD:-0/1}
if ! [[ $shard =~ ^([0-9]+)/([1-9][0-9]*)$ ]] || [ "${BASH_REMATCH[1]}" -ge "${BASH_REMATCH[2]}" ]; then
  echo "SHARD must be i/n with 0 <= i < n, got $shard" >&2
  exit 2
fi
index=${BASH_REMATCH[1]} count=${BASH_REMATCH[2]}
if [ $# -eq 0 ]; then
  set -- $(grep -l 'default_backend()\|on_hopper' tests/test_*.py)
fi
mkdir -p "$out"
start=$SECONDS
for f in "$@"; do
  name=$(basename "$f" .py)
  left=$((deadline - (SECONDS - start)))
  if [ "$left" -lt 20 ]; then
    echo "$name: not run (time)"
    continue
  fi
  tests=("tests/$name.py")
  if [ "$count" -gt 1 ]; then
    mapfile -t tests < <(python3 -P -m pytest -p no:cacheprovider -p no:warnings -o addopts= --collect-only -q "tests/$name.py" 2>/dev/null \
                         | grep "^tests/.*::" | awk -v i="$index" -v n="$count" '(NR - 1) % n == i')
    if [ ${#tests[@]} -eq 0 ]; then
      echo "$name: no test in shard $shard"
      continue
    fi
  fi
  timeout "$left" python3 -P -m pytest -p no:cacheprovider -rfE "${tests[@]}" > "$out/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - start)) s: $(tail -n 1 "$out/$name.log")"
done
