#!/usr/bin/env bash
# On a GPU machine without registry access, from the repository root, with the wheels of
# bench/gpu_wheels.sh carried in .whl/:
#   bash bench/gpu_session.sh tests              # the `cuda` legs of tests/kernels
#   bash bench/gpu_session.sh bench [ARGS...]    # bench/gpu_mfu.py ARGS (e.g. --only ...)
#   bash bench/gpu_session.sh profile [ARGS...]  # bench/gpu_profile.py ARGS (-- FLAGS...)
#   bash bench/gpu_session.sh fp8loss [ARGS...]  # bench/fp8_loss.py ARGS: FP8 vs bf16 losses
# Logs and results go to bench/results/gpu_mfu, or, under the device tool (which brings back
# at most 8 files from $OUT), to /tmp/gpu_results, packed into $OUT/gpu_results.tgz after each
# phase and every 30 s during it: a phase cut off by a time limit skips the EXIT trap, and
# what it wrote still comes back. fp8loss reads the corpus (`make data` here, then carry
# data/shakespeare_text_document.bin, .idx and data/shakespeare_sp.model). The wheels install
# under /tmp/site, beside the machine's own torch.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=bench/results/gpu_mfu
if [ -n "${OUT:-}" ]; then
  out=/tmp/gpu_results
  mkdir -p "$out"
  pack() {
    tar -C "$out" -czf "$OUT/gpu_results.part" . && mv "$OUT/gpu_results.part" "$OUT/gpu_results.tgz"
  }
  (while sleep 30; do pack; done) &
  packer=$!
  trap 'kill "$packer" 2>/dev/null; pack' EXIT
fi
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi >"$out/nvidia-smi.txt" 2>&1
phase="${1:-bench}"
shift || true
case "$phase" in
  tests) python3 -m pytest -q -p no:cacheprovider -rs tests/kernels -k cuda \
           2>&1 | tee "$out/device_tests.log" ;;
  bench) python3 bench/gpu_mfu.py --out "$out" "$@" 2>&1 | tee "$out/gpu_mfu_stderr.log" ;;
  profile) python3 bench/gpu_profile.py "$@" 2>&1 | tee -a "$out/profile.txt" ;;
  fp8loss) python3 bench/fp8_loss.py --out "$out/fp8_loss" "$@" 2>&1 | tee "$out/fp8_loss.txt" ;;
  *) echo "bench/gpu_session.sh: unknown phase '$phase'; use tests, bench, profile or fp8loss" >&2
     exit 2 ;;
esac
