#!/usr/bin/env bash
# The GPU proof: one command for one run on a GPU machine that has PyTorch and no network. It
# installs what the machine lacks from the wheels in .whl/ (an ignored folder of the checkout),
# then runs the sections below, each under its own time cap and all under one deadline, and
# writes OUT/gpu_proof.md, OUT/gpu_proof.json (every section's numbers) and OUT/gpu_proof.log.
# A section that fails or runs out of time is recorded and the others still run; the exit status
# is non-zero when a section failed. The report is rewritten after every section.
#
#   world      bench.gpu_world: a Qwen3-8B-shaped target checkpoint and a paper-size FlashMap
#              drafter checkpoint, random weights (~18 GB in the work directory)
#   a          bench.gpu: target step, verify of 17, drafter jumps, fp32 / bf16 exactness, the
#              batch-invariant mode
#   b          bench.gpu_e2e: whole decode loops in process (target alone, oracle, FlashMap 1 and 2
#              jumps, DFlash, EAGLE-3) at batch 1 / 4 / 16 against their kernels
#   c          bench.gpu_stack: the served stack (Triton + drafter + orchestrator) against the
#              in-process loop with the same drafters, concurrency 1 and 16; needs a tritonserver
#              (nvidia-pytriton), else it says so and is skipped
#   d-*        training.generate_data, then training.train_drafter under torchrun on one GPU: timed
#              steps of the flow stage and of distillation, paper-size drafter, online features
#
#   bash scripts/gpu-proof.sh --out DIR            on the GPU machine (~8 minutes on an H200)
#   bash scripts/gpu-proof.sh --smoke --out DIR    every section on the CPU at tiny shapes (CI)
#   bash scripts/gpu-proof.sh --fetch-wheels [--python-version 3.12] [--with-pytriton]
#                                                  on a machine with PyPI, before: fills .whl/
# More: --work DIR (default: a new temporary directory, removed at the end unless --keep-work),
# --only a,c (sections; world is made when c or d needs it), --deadline SECONDS (default 480 on a
# GPU), PYTHON=... (default: python3 on a GPU, .venv/bin/python with --smoke).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

SMOKE=0 FETCH=0 PYV=3.12 WITH_PYTRITON=0 KEEP=0 OUT="" WORK="" ONLY="" DEADLINE=""
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --out) OUT=$2; shift ;;
    --work) WORK=$2; shift ;;
    --keep-work) KEEP=1 ;;
    --only) ONLY=$2; shift ;;
    --deadline) DEADLINE=$2; shift ;;
    --fetch-wheels) FETCH=1 ;;
    --python-version) PYV=$2; shift ;;
    --with-pytriton) WITH_PYTRITON=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu-proof: unknown option $1 (--help)" >&2; exit 2 ;;
  esac
  shift
done

# ----------------------------------------------------------------------------- --fetch-wheels
if [ "$FETCH" = 1 ]; then
  PY=${PYTHON:-.venv/bin/python}
  [ -x "$PY" ] || bash scripts/setup.sh
  plats=()
  for n in $(seq 5 39); do plats+=(--platform "manylinux_2_${n}_x86_64"); done
  plats+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  extra=()
  [ "$WITH_PYTRITON" = 1 ] && extra=(--with-pytriton)
  mapfile -t pkgs < <("$PY" -m bench.gpu_proof_wheels fetch-list "${extra[@]}")
  mkdir -p .whl
  rm -f .whl/*.whl # one version of each: two would stop the install
  echo "gpu-proof: downloading for Python $PYV: ${pkgs[*]}"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" \
    --implementation cp "${plats[@]}" -d .whl "${pkgs[@]}" || exit 1
  size=$(du -sm .whl | cut -f1)
  echo "gpu-proof: .whl/ holds ${size} MiB"
  if [ "$size" -gt 50 ]; then
    echo "gpu-proof: note: over 50 MiB; with the checkout it may not fit a machine that takes 64 MiB"
  fi
  exit 0
fi

# ----------------------------------------------------------------------------- the run
if [ -z "$OUT" ]; then
  echo "gpu-proof: --out DIR is required (--help)" >&2
  exit 2
fi
if [ "$SMOKE" = 0 ] && ! "${PYTHON:-python3}" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  echo "gpu-proof: ${PYTHON:-python3} sees no CUDA device: on a machine without one, run --smoke" >&2
  exit 2
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
OWN_WORK=0
if [ -z "$WORK" ]; then
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-proof.XXXXXX")
  OWN_WORK=1
fi
mkdir -p "$WORK/logs" "$WORK/d"
WORK=$(cd "$WORK" && pwd)
: >"$WORK/sections.tsv"
exec > >(tee -a "$OUT/gpu_proof.log") 2>&1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [ "$SMOKE" = 1 ]; then
  PY=${PYTHON:-.venv/bin/python}
  [ -x "$PY" ] || bash scripts/setup.sh
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  DEADLINE=${DEADLINE:-900}
  DEVICE="CPU (smoke run)"
else
  PY=${PYTHON:-python3}
  DEADLINE=${DEADLINE:-480}
  DEVICE=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1)
fi
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo "unknown (no git)")
[ -n "$(git status --porcelain 2>/dev/null)" ] && COMMIT="$COMMIT + uncommitted changes"
T0=$SECONDS
RESERVE=10 # seconds kept for the last report
echo "== gpu-proof: $(date -u '+%F %T') UTC, device ${DEVICE:-none}, commit $COMMIT, python $PY"
echo "   out $OUT, work $WORK, deadline ${DEADLINE} s"

wanted() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]] || [[ "$1" == d-* && ",$ONLY," == *",d,"* ]]; }

report() {
  "$PY" -m bench.gpu_proof --work "$WORK" --out "$OUT" --device "${DEVICE:-unknown}" \
    --commit "$COMMIT" --total-s $((SECONDS - T0)) $([ "$SMOKE" = 1 ] && echo --smoke) \
    --command "bash scripts/gpu-proof.sh $ARGS" "$@"
}
ARGS="$([ "$SMOKE" = 1 ] && echo '--smoke ')--out OUT${ONLY:+ --only $ONLY}"

# cap NOMINAL: the seconds a section may take, within the deadline (0: none left)
cap() {
  local left=$((DEADLINE - (SECONDS - T0) - RESERVE))
  if [ "$left" -lt 15 ]; then echo 0; elif [ "$1" -gt "$left" ]; then echo "$left"; else echo "$1"; fi
}

# section NAME CAP COMMAND...: run it under `timeout`, its output to the log, its line to sections.tsv
section() {
  local name=$1 limit=$2 rc t=$SECONDS
  shift 2
  printf '\n== [%4d s] section %s (cap %s s): %s\n' $((SECONDS - T0)) "$name" "$limit" "$*"
  if [ "$limit" -le 0 ]; then
    echo "   no time left before the deadline: not run"
    rc=124
  else
    timeout --kill-after=20 "$limit" "$@" 2>&1 | tee "$WORK/logs/$name.log"
    rc=${PIPESTATUS[0]}
  fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" $((SECONDS - t)) "$limit" "$*" >>"$WORK/sections.tsv"
  echo "   section $name: exit $rc after $((SECONDS - t)) s"
  report >/dev/null 2>&1 || true
  return 0
}

# The stack's services run in sessions of their own (flashmap_cli.stack): a section killed at its
# cap cannot stop them, so their process groups, as bench.gpu_stack recorded them, are ended here.
end_stack() {
  local f="$WORK/c/pids" p
  [ -f "$f" ] || return 0
  for p in $(cat "$f"); do kill -TERM -- "-$p" 2>/dev/null; done
  sleep 3
  for p in $(cat "$f"); do kill -KILL -- "-$p" 2>/dev/null; done
  rm -f "$f"
}

if [ "$SMOKE" = 1 ]; then
  W_ARGS=(--smoke) A_ARGS=(--smoke --skip training) B_ARGS=(--smoke) C_ARGS=(--smoke)
  DATA_ARGS=(--max-new-tokens 24 --max-seq-len 80 --chunk-size 16 --slots 16 --device cpu)
  TRAIN=(--device cpu --small --batch-size 8 --anchors-per-seq 2 --max-len 64)
  ACCUM=1 FLOW_STEPS=4 DISTILL_STEPS=3
else
  W_ARGS=() C_ARGS=()
  DATA_ARGS=(--max-new-tokens 48 --max-seq-len 2064 --chunk-size 32 --slots 32)
  TRAIN=(--batch-size 256 --anchors-per-seq 8 --max-len 2048)
  # under 100 GB (an H100): the same 256 blocks a step in two micro-batches
  MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  ACCUM=1
  [ -n "$MEM" ] && [ "$MEM" -lt 100000 ] && ACCUM=2
  FLOW_STEPS=6 DISTILL_STEPS=5
fi
TRAIN+=(--accum-steps "$ACCUM" --log-every 1 --save-every 100000 --accept-every 0 --no-progress)
read -r BS APS ML < <(printf '%s\n' "${TRAIN[@]}" | awk '
  p == "--batch-size" {b = $0} p == "--anchors-per-seq" {a = $0} p == "--max-len" {m = $0} {p = $0}
  END {print b, a, m}')
printf '{"batch_size": %s, "anchors_per_seq": %s, "max_len": %s, "accum_steps": %s}\n' \
  "$BS" "$APS" "$ML" "$ACCUM" >"$WORK/d/settings.json"
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m training.train_drafter)
W="$WORK/world"

if true; then # every run: what the sections import must be there first
  if [ "$SMOKE" = 1 ]; then
    section wheels "$(cap 60)" "$PY" -m bench.gpu_proof_wheels install --dry-run
  else
    section wheels "$(cap 90)" "$PY" -m bench.gpu_proof_wheels install
  fi
fi
# a: bench.gpu's time guard skips a part unless its generous need fits in what is left, so its
# budget stays above the cap (~40 s of work on an H200); b: 64 new tokens a row, guarded within
# the cap (a row that would not fit is reported as skipped).
if wanted a; then
  [ "$SMOKE" = 1 ] || A_ARGS=(--skip cuda_tests,training --budget 200)
  section a "$(cap 90)" "$PY" -m bench.gpu --out "$WORK/a" "${A_ARGS[@]}"
fi
if wanted b; then
  c=$(cap 170)
  [ "$SMOKE" = 1 ] || B_ARGS=(--max-new-tokens 64 --budget $((c > 60 ? c - 30 : 30)))
  section b "$c" "$PY" -m bench.gpu_e2e --out "$WORK/b" "${B_ARGS[@]}"
fi
if { wanted c || wanted d-data || wanted d-flow; } && [ ! -f "$W/world.json" ]; then
  section world "$(cap 90)" "$PY" -m bench.gpu_world --out "$W" "${W_ARGS[@]}"
fi
if wanted c; then
  section c "$(cap 150)" "$PY" -m bench.gpu_stack --world "$W" --out "$WORK/c" "${C_ARGS[@]}"
  end_stack
fi
if wanted d-data; then
  section d-data "$(cap 60)" "$PY" -m training.generate_data --target "$W/target" \
    --prompts "$W/prompts.jsonl" --out "$WORK/d/data" --temperature 0 --no-progress "${DATA_ARGS[@]}"
fi
if wanted d-flow; then
  section d-flow "$(cap 100)" "${TORCHRUN[@]}" --stage flow --target "$W/target" \
    --data "$WORK/d/data" --out "$WORK/d/flow" --steps "$FLOW_STEPS" --check-batches 0 "${TRAIN[@]}"
  rm -f "$WORK/d/flow/train_state.pt" # ~11 GB; distillation reads the drafter checkpoint
fi
if wanted d-distill; then
  section d-distill "$(cap 100)" "${TORCHRUN[@]}" --stage distill --teacher "$WORK/d/flow" \
    --target "$W/target" --data "$WORK/d/data" --out "$WORK/d/map" --steps "$DISTILL_STEPS" \
    "${TRAIN[@]}"
  rm -f "$WORK/d/map/train_state.pt"
fi

printf '\n== [%4d s] report\n' $((SECONDS - T0))
report
rc=$?
[ "$OWN_WORK" = 1 ] && [ "$KEEP" = 0 ] && rm -rf "$WORK"
echo "== gpu-proof: done in $((SECONDS - T0)) s, exit $rc; report $OUT/gpu_proof.md"
exit $rc
