#!/usr/bin/env bash
# The test files that take other branches on a GPU, run on a GPU host against an installed jengine
# (`pip install .`, not editable: `python -P` keeps the source tree's `jengine/` off the path), each file in
# a pytest process of its own, since a file's engines keep most of the device for the process's life.
#
#   bash tests/gpu_files.sh LOG_DIR SECONDS [FILE ...]
#
# FILE: test file names (default: those naming the GPU backend). Each file's log goes to LOG_DIR/NAME.log
# and one line per file is printed; files not started SECONDS after the first are reported as not run.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ] || ! [[ $2 =~ ^[0-9]+$ ]]; then
  echo "usage: bash tests/gpu_files.sh LOG_DIR SECONDS [FILE ...]  (SECONDS: a whole number)" >&2
  exit 2
fi
out=$1 deadline=$2
shift 2
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
  timeout "$left" python3 -P -m pytest -p no:cacheprovider -rfE "tests/$name.py" > "$out/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - start)) s: $(tail -n 1 "$out/$name.log")"
done
