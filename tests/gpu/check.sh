#!/usr/bin/env bash
# The prepared GPU check: one run, about 4-6 minutes on a fresh NVIDIA machine with
# no network. Uses the python3 (and torch) already there; deltafind's own missing pure-Python
# dependencies travel as wheels in .whl/ (see tests/gpu/README.md). Steps:
#   1. refuse at once, non-zero, without a CUDA device;
#   2. make deltafind importable from this tree (wheels -> $WORK/site, PYTHONPATH; no pip index);
#   3. run the GPU tests (pytest -m gpu tests/gpu);
#   4. build the streaming synthetic K3 `bench` store (~3.4 GB; 38 s on a 2-core VM);
#   5. print ONE JSON line: decode tok/s, H2D GB/s vs a torch pinned-copy peak, copy time hidden,
#      GPU-vs-CPU speedup (tests/gpu/bench_gpu.py), with the test result and setup time merged in.
# Each step has its own time limit (150 + 150 + 240 s), so a hung step still leaves the others' output.
# Exit status: 0 when the tests pass and the bench ran; 3 without CUDA; 4 import/setup/bench failure; 1 tests failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
WORK=${DF_GPU_WORK:-/tmp/df-gpu}
TOKENS=${DF_GPU_TOKENS:-6}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "check.sh: no CUDA device: $PY cannot import torch or torch.cuda.is_available() is False; run it on a machine with an NVIDIA GPU (the device tool's nvidia-h200)" >&2
    exit 3
fi
mkdir -p "$WORK"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl || exit 4
    export PYTHONPATH="$WORK/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c 'import deltafind.api, deltafind.cli, pytest' 2>"$WORK/import.err"; then
    echo "check.sh: deltafind does not import here; carry its missing dependencies as wheels (.whl/, tests/gpu/README.md):" >&2
    tail -3 "$WORK/import.err" >&2
    exit 4
fi
"$PY" -c 'import torch; print("check.sh:", torch.__version__, torch.cuda.get_device_name(0), file=__import__("sys").stderr)'

t0=$(date +%s)
timeout 150 "$PY" -m pytest -m gpu tests/gpu -q -p no:cacheprovider -o addopts="" >"$WORK/pytest.log" 2>&1
tests_rc=$?
t1=$(date +%s)
tail -15 "$WORK/pytest.log" >&2
summary=$(tail -1 "$WORK/pytest.log" | tr -d '=' | sed 's/^ *//; s/ *$//; s/"//g')

STORE="$WORK/k3-bench"
if [ ! -f "$STORE/manifest.json" ]; then
    rm -rf "$STORE"
    timeout 150 "$PY" -m deltafind.cli setup --synthetic kimi_k3 --shape bench --store "$STORE" --quiet >&2 || exit 4
fi
t2=$(date +%s)
store_bytes=$(du -sb "$STORE" | cut -f1)

extra=$(printf '{"gpu_tests": "%s", "gpu_tests_rc": %d, "gpu_tests_s": %d, "setup_s": %d, "store_bytes": %s}' \
    "$summary" "$tests_rc" $((t1 - t0)) $((t2 - t1)) "$store_bytes")
timeout 240 "$PY" tests/gpu/bench_gpu.py --store "$STORE" --tokens "$TOKENS" --extra "$extra" || exit 4
[ "$tests_rc" -eq 0 ] || exit 1
