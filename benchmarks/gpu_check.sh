#!/usr/bin/env bash
# GPU check of pimm's CUDA/NCCL paths, in one short run (about 4 minutes on one node).
#
# On every visible GPU (torchrun --nproc-per-node = the GPUs nvidia-smi lists), through
# the benchmarks of this directory, each stage time-limited:
#   step_ddp_bf16           sharded_step.py:  pimm's Trainer vs a hand-written DDP loop, train.amp = "bf16"
#   step_fsdp_bf16_compile  sharded_step.py:  pimm vs a hand-written FSDP2 loop, bf16 autocast,
#                                             fsdp.param_dtype = "bfloat16", train.compile = true
#   memory_bf16             fsdp_memory.py:   CUDA peak and per-rank params+grads+optimizer bytes, DDP vs FSDP
#   checkpoint              sharded_checkpoint.py: standard save/load of DDP vs FSDP, checkpoint.async
#                                             stall, the FSDP checkpoint resumed at 1 rank (and at half
#                                             the GPUs with 4 or more)
# Each stage's JSON goes to $OUT/<stage>.json (its log to <stage>.log); the last line
# printed is one JSON summary of every stage (status, seconds, headline figures).
#
# Usage (from a clone, after `uv sync`):
#   benchmarks/gpu_check.sh [--out DIR] [--cpu-smoke]
# --cpu-smoke runs the same stages on CPU (gloo, 2 ranks, tiny sizes) to check the
# plumbing on a machine without a GPU. Env: STAGE_TIMEOUT (seconds per stage, default
# 150; 300 with --cpu-smoke), NPROC (ranks; default: the GPUs listed).
# Exit status: 0 every stage passed; 1 a stage failed or timed out; 2 bad usage or no uv;
# 3 no CUDA device (one line, nothing run).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
SMOKE=0
OUT=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu-smoke) SMOKE=1; shift ;;
    --out) OUT="${2:?--out needs a directory}"; shift 2 ;;
    -h|--help) sed -n '2,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1'; use --out DIR and/or --cpu-smoke" >&2; exit 2 ;;
  esac
done
need_uv() {
  if ! command -v uv >/dev/null 2>&1; then
    echo "gpu_check: uv not found on PATH; install it (pip install uv) and run 'uv sync' in this clone" >&2
    exit 2
  fi
}

if [[ $SMOKE == 1 ]]; then
  need_uv
  DEVICE=cpu
  NPROC="${NPROC:-2}"
  STAGE_TIMEOUT="${STAGE_TIMEOUT:-300}"
  STEP_SIZE=(--width 128 --depth 2 --batch 8 --steps 8 --repeats 1 --skip 2)
  MEM_SIZE=(--width 256 --depth 2 --batch 8 --steps 2)
  CKPT_SIZE=(--width 256 --depth 2 --repeats 1 --pause 0)
  RESHARD=(1 3)
else
  NGPU=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  fi
  if [[ "$NGPU" -lt 1 ]]; then
    echo "gpu_check: no CUDA device (nvidia-smi lists no GPU); nothing checked (--cpu-smoke checks the plumbing on CPU)"
    exit 3
  fi
  need_uv
  if ! uv run python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    echo "gpu_check: nvidia-smi lists $NGPU GPU(s) but this clone's torch cannot use CUDA (torch.cuda.is_available() is False); nothing checked"
    exit 3
  fi
  DEVICE=cuda
  NPROC="${NPROC:-$NGPU}"
  STAGE_TIMEOUT="${STAGE_TIMEOUT:-150}"
  STEP_SIZE=(--width 2048 --depth 8 --batch 64 --steps 40 --repeats 1 --skip 5)
  MEM_SIZE=(--width 2048 --depth 8 --batch 64 --steps 3)
  CKPT_SIZE=(--width 2048 --depth 4 --repeats 2 --pause 0.5)
  RESHARD=(1)
  if [[ "$NPROC" -ge 4 ]]; then RESHARD+=($((NPROC / 2))); fi
  if [[ "$NPROC" -lt 2 ]]; then RESHARD=(); fi  # one GPU: resharding 1 -> 1 is the same-size load
fi
OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/pimm-gpu-check-XXXXXX")}"
mkdir -p "$OUT"
BF16=('train.amp="bf16"' 'fsdp.param_dtype="bfloat16"')
echo "gpu_check: device $DEVICE, $NPROC rank(s), stage limit ${STAGE_TIMEOUT}s, output in $OUT" >&2

declare -A RC SECS
STAGES=()
stage() {  # stage NAME CMD...: run CMD under timeout, JSON to $OUT/NAME.json, stderr to $OUT/NAME.log
  local name=$1; shift
  STAGES+=("$name")
  echo "gpu_check: stage $name ..." >&2
  local t0=$SECONDS rc=0
  timeout --kill-after=10 "$STAGE_TIMEOUT" "$@" >"$OUT/$name.json" 2>"$OUT/$name.log" || rc=$?
  RC[$name]=$rc
  SECS[$name]=$((SECONDS - t0))
  if [[ $rc == 0 ]]; then
    echo "gpu_check: stage $name passed (${SECS[$name]}s)" >&2
  else
    [[ $rc == 124 || $rc == 137 ]] && echo "gpu_check: stage $name timed out after ${STAGE_TIMEOUT}s" >&2 \
      || echo "gpu_check: stage $name failed (exit $rc); see $OUT/$name.log" >&2
    tail -n 5 "$OUT/$name.log" >&2 || true
  fi
}

COMMON=(--nproc "$NPROC" --device "$DEVICE")
stage step_ddp_bf16 uv run python benchmarks/sharded_step.py "${COMMON[@]}" "${STEP_SIZE[@]}" --strategies ddp \
  -- 'train.amp="bf16"'
stage step_fsdp_bf16_compile uv run python benchmarks/sharded_step.py "${COMMON[@]}" "${STEP_SIZE[@]}" \
  --strategies fsdp -- "${BF16[@]}" 'train.compile=true'
stage memory_bf16 uv run python benchmarks/fsdp_memory.py "${COMMON[@]}" "${MEM_SIZE[@]}" -- "${BF16[@]}"
stage checkpoint uv run python benchmarks/sharded_checkpoint.py "${COMMON[@]}" "${CKPT_SIZE[@]}" --async-stall \
  --reshard "${RESHARD[@]}"

SUMMARY_ARGS=()
for s in "${STAGES[@]}"; do SUMMARY_ARGS+=("$s" "${RC[$s]}" "${SECS[$s]}"); done
uv run python benchmarks/gpu_check_summary.py "$OUT" "$DEVICE" "$NPROC" "${SUMMARY_ARGS[@]}" || exit 1
