#!/usr/bin/env bash
# On a GPU machine without registry access, from the repository root, with the wheels of
# bench/gpu_wheels.sh carried in .whl/:
#   bash bench/gpu_session.sh tests              # the `cuda` legs of tests/kernels, data
#   bash bench/gpu_session.sh bench [ARGS...]    # bench/gpu_mfu.py ARGS (e.g. --only ...)
#   bash bench/gpu_session.sh profile [ARGS...]  # bench/gpu_profile.py ARGS (-- FLAGS...), the
#                                                # code Inductor generates for the run, and the
#                                                # trace (profile_trace_N.json.gz in $OUT,
#                                                # else in gpu_mfu/)
#   bash bench/gpu_session.sh fp8loss [ARGS...]  # bench/fp8_loss.py ARGS: FP8 vs bf16 losses
#   bash bench/gpu_session.sh resume [ARGS...]   # bench/fp8_resume.py ARGS: FP8 stop and resume
#   bash bench/gpu_session.sh checks [RUNS...]   # tests, fp8loss RUNS (default all) and resume
#                                                # side by side (none timed: they share the GPU)
#   bash bench/gpu_session.sh at REV [ARGS...]   # bench/gpu_mfu.py ARGS as it was at commit
#                                                # REV, beside this tree's rows: its tree carried
#                                                # in .old/REV (`mkdir -p .old/REV && git archive
#                                                # REV | tar -x -C .old/REV`, carry .old)
# Phases chain, separated by a lone comma, in one install and one lease of the device:
#   bash bench/gpu_session.sh checks , bench --shape 8b-8l --only ... , bench --only ...
# bench writes to gpu_mfu/ (gpu_mfu_8b-8l/ with --shape 8b-8l, gpu_moe/ with --moe) under
# bench/results, or, under the device tool (which brings back at most 8 files from $OUT),
# under /tmp/gpu_results, packed into $OUT/gpu_results.tgz after each phase and every 10 s
# during it: a phase cut off by a time limit still brings back what it wrote. fp8loss, resume
# and checks read the corpus (`make data` here, then carry data/shakespeare_text_document.bin,
# .idx and data/shakespeare_sp.model). The wheels install under /tmp/site, beside the
# machine's torch.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=bench/results
if [ -n "${OUT:-}" ]; then
  out=/tmp/gpu_results
  mkdir -p "$out"
  pack() {
    tar -C "$out" -czf "$OUT/gpu_results.part" . && mv "$OUT/gpu_results.part" "$OUT/gpu_results.tgz"
  }
  (while sleep 10; do pack; done) &
  packer=$!
  trap 'kill "$packer" 2>/dev/null; pack' EXIT
fi
mkdir -p "$out/gpu_mfu"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi >"$out/gpu_mfu/nvidia-smi.txt" 2>&1
logs="$out/gpu_mfu"
device_tests=(tests/kernels tests/data/test_loader.py tests/model/test_activation_offload.py
  tests/model/test_grouped_experts.py tests/training/test_precision_aware.py)  # their `cuda` legs
profiles=0

run_phase() {
  local phase="${1:-bench}"
  shift || true
  case "$phase" in
    tests) python3 -m pytest -q -p no:cacheprovider -rs "${device_tests[@]}" -k cuda 2>&1 \
             | tee "$logs/device_tests.log" ;;
    bench)
      local dir="$out/gpu_mfu" previous=""
      for arg in "$@"; do  # a wider shape's or the MoE's results beside the 1B ones
        [ "$previous" = --shape ] && [ "$arg" != 1b ] && dir="$out/gpu_mfu_$arg"
        [ "$arg" = --moe ] && dir="$out/gpu_moe"
        previous="$arg"
      done
      mkdir -p "$dir"
      python3 bench/gpu_mfu.py --out "$dir" "$@" 2>&1 | tee "$dir/gpu_mfu_stderr.log" ;;
    at)
      # the old script puts its own tree first on sys.path, in its contenders' processes too
      local rev="${1:?at: which commit (its tree in .old/REV)}"
      shift
      [ -f ".old/$rev/bench/gpu_mfu.py" ] || { echo "at: no .old/$rev/bench/gpu_mfu.py;" \
        "unpack the commit there (git archive) and carry .old" >&2; return 2; }
      mkdir -p "$out/gpu_mfu_at_$rev"
      python3 ".old/$rev/bench/gpu_mfu.py" --out "$out/gpu_mfu_at_$rev" "$@" 2>&1 \
        | tee "$out/gpu_mfu_at_$rev/gpu_mfu_stderr.log" ;;
    profile)  # each profile's trace, read by bench/gpu_timeline.py: under the device tool a
      # file of its own in $OUT (a 1B step's trace is a few MiB gzipped; the tarball must stay
      # under the 16 MiB a file that comes back may have)
      profiles=$((profiles + 1))
      local trace="$logs/profile_trace_$profiles.json.gz"
      [ -n "${OUT:-}" ] && trace="$OUT/profile_trace_$profiles.json.gz"
      python3 bench/gpu_profile.py --output-code "$logs/inductor_code.txt" --trace "$trace" \
        "$@" 2>&1 | tee -a "$logs/profile.txt" ;;
    fp8loss) python3 bench/fp8_loss.py --out "$out/fp8_loss" "$@" 2>&1 | tee "$logs/fp8_loss.txt" ;;
    resume) python3 bench/fp8_resume.py --out "$out/fp8_resume" "$@" 2>&1 \
              | tee "$logs/fp8_resume.txt" ;;
    checks)
      # side by side: each loss run in its own process (ARGS: which, default all seven; the
      # report once all are done), the resume cases in deterministic mode (the recipes among
      # RUNS, fp8_delayed -> delayed; all three if none is), the `cuda` tests
      local runs=("$@") pids=() recipes=()
      [ ${#runs[@]} -eq 0 ] && runs=(base fp8_delayed fp8_tensorwise fp8_delayed_margin1
                                     fp8_rowwise fp8_rowwise_hybrid fp8_blockwise)
      for run in "${runs[@]}"; do
        python3 bench/fp8_loss.py --out "$out/fp8_loss" --only "$run" --no-report \
          >"$logs/fp8_loss_$run.txt" 2>&1 &
        pids+=($!)
        case "$run" in
          fp8_delayed | fp8_tensorwise | fp8_blockwise) recipes+=("${run#fp8_}") ;;
        esac
      done
      [ ${#recipes[@]} -eq 0 ] && recipes=(delayed tensorwise blockwise)
      python3 bench/fp8_resume.py --out "$out/fp8_resume" --modes deterministic --jobs 3 \
        --recipes "${recipes[@]}" >"$logs/fp8_resume.txt" 2>&1 &
      pids+=($!)
      python3 -m pytest -q -p no:cacheprovider -rs "${device_tests[@]}" -k cuda \
        >"$logs/device_tests.log" 2>&1
      wait "${pids[@]}"  # (not the packer)
      python3 bench/fp8_loss.py --out "$out/fp8_loss" --only >"$logs/fp8_loss.txt" 2>&1
      tail -n 4 "$logs/device_tests.log" "$logs/fp8_loss.txt" "$logs/fp8_resume.txt" ;;
    *) echo "bench/gpu_session.sh: unknown phase '$phase'; use tests, bench, at, profile," \
         "fp8loss, resume or checks" >&2
       return 2 ;;
  esac
  [ -n "${OUT:-}" ] && pack
  return 0
}

args=()
for arg in "$@" ","; do  # a final "," runs the last phase
  if [ "$arg" = , ]; then
    [ "${#args[@]}" -gt 0 ] && { run_phase "${args[@]}" || exit; }
    args=()
  else
    args+=("$arg")
  fi
done
