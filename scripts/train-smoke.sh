#!/usr/bin/env bash
# The README's drafter-training chain ("Train a drafter for your target") on a tiny random
# Qwen3, on the CPU, with two torchrun processes (gloo): token data from the target -> the
# flow stage on 2 ranks (killed by SIGKILL after step 3, then resumed) -> flow-map
# distillation on 2 ranks -> export -> served by `flashmap up` -> the served greedy output
# equals the target alone's. Exits non-zero on any failure or mismatch. CI runs it (.ci/run).
#
#   bash scripts/train-smoke.sh [WORK_DIR]     (default: a new temporary directory)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/torchrun ] || bash scripts/setup.sh
WORK="${1:-$(mktemp -d -t flashmap-train-smoke.XXXXXX)}"
mkdir -p "$WORK"
PY=.venv/bin/python
export OMP_NUM_THREADS=1 # one thread per rank: two ranks on two cores
T0=$SECONDS
step() { printf '\n== [%3d s] %s\n' $((SECONDS - T0)) "$*"; }
run() {
  echo "+ $*"
  "$@"
}

step "0. a tiny random Qwen3 with a tokenizer (stands for your Hugging Face directory), prompt files"
run $PY -m training.smoke_check world "$WORK"
T="$WORK/target"

step "1. token data: the target's own responses (training and held-out prompts)"
# Greedy (the README's default is T = 1): a few CPU steps learn these 12 answers by heart, so
# the served check below sees drafts accepted (training prompts) and rejected (held-out ones).
run $PY -m training.generate_data --target "$T" --prompts "$WORK/prompts.jsonl" --out "$WORK/data" \
  --max-new-tokens 48 --temperature 0 --chunk-size 8 --slots 8 --device cpu --no-progress
run $PY -m training.generate_data --target "$T" --prompts "$WORK/heldout.jsonl" --out "$WORK/heldout" \
  --max-new-tokens 48 --temperature 0 --device cpu --no-progress

TORCHRUN=(.venv/bin/torchrun --standalone --nproc-per-node 2 -m training.train_drafter)
COMMON=(--target "$T" --data "$WORK/data" --device cpu --small --batch-size 32 --anchors-per-seq 8
  --log-every 10 --save-every 100 --no-progress --accept-every 100 --accept-data "$WORK/heldout")
FLOW=(--stage flow --out "$WORK/flow" --steps 300 --lr 3e-3 --warmup-steps 10 --check-batches 1)

step "2. flow stage on 2 ranks, killed after step 150 (SIGKILL; the last checkpoint is step 100)"
if FLASHMAP_TRAIN_KILL_AFTER_STEP=150 run "${TORCHRUN[@]}" "${FLOW[@]}" "${COMMON[@]}" \
  >"$WORK/killed.log" 2>&1; then
  echo "FAILED: the run was to be killed after step 150" >&2
  exit 1
fi
grep -q "SIGKILL" "$WORK/killed.log" || {
  cat "$WORK/killed.log"
  echo "FAILED: the run did not die by SIGKILL" >&2
  exit 1
}
echo "killed as planned (torchrun: exit code -9); loss.csv has steps $(cut -d, -f1 "$WORK/flow/loss.csv" | tail -n +2 | tr '\n' ' ')"

step "2b. the same command with --resume: continues from step 100 to step 300"
run "${TORCHRUN[@]}" "${FLOW[@]}" "${COMMON[@]}" --resume

step "3. flow-map distillation on 2 ranks (teacher: the flow stage)"
run "${TORCHRUN[@]}" --stage distill --teacher "$WORK/flow" --out "$WORK/map" --steps 40 "${COMMON[@]}" \
  --accept-every 20
$PY - "$WORK" <<'EOF'
import sys, torch
w = sys.argv[1]
for run, steps in (("flow", 300), ("map", 40)):
    st = torch.load(f"{w}/{run}/train_state.pt", weights_only=False, map_location="cpu")
    assert st["step"] == steps and st["world_size"] == 2 and len(st["rng"]) == 2, (run, st["step"])
    print(f"{run}: step {st['step']}, 2 ranks' RNG, data position {st['data']['position']}")
EOF

step "4. export the drafter (bf16 weights, no training state)"
run $PY -m training.export_drafter "$WORK/map" "$WORK/drafter"

step "5. serve it: flashmap up --target TARGET --drafter DRAFTER"
read -r P_GRPC P_DRAFTER P_THTTP P_TGRPC P_TMETRICS < <($PY -c \
  "from flashmap_cli.stack import free_ports; print(*free_ports(5))")
.venv/bin/flashmap up --target "$T" --drafter "$WORK/drafter" --port "$P_GRPC" \
  --drafter-port "$P_DRAFTER" --triton-http-port "$P_THTTP" --triton-grpc-port "$P_TGRPC" \
  --triton-metrics-port "$P_TMETRICS" --metrics-port 0 --drafter-metrics-port 0 --http-port 0 \
  --n-slots 4 --max-seq-len 256 --speculation full --log-dir "$WORK/logs" >"$WORK/up.log" 2>&1 &
UP=$!
trap 'kill -TERM $UP 2>/dev/null || true; wait $UP 2>/dev/null || true' EXIT
for _ in $(seq 240); do
  grep -q "FlashMap Serve is up" "$WORK/up.log" && break
  kill -0 $UP 2>/dev/null || {
    cat "$WORK/up.log"
    echo "FAILED: flashmap up exited" >&2
    exit 1
  }
  sleep 1
done
grep -q "FlashMap Serve is up" "$WORK/up.log" || {
  cat "$WORK/up.log"
  echo "FAILED: flashmap up did not come up in 240 s" >&2
  exit 1
}
sed -n '/FlashMap Serve is up/,$p' "$WORK/up.log"

step "6. the served greedy output equals the target alone's (training and held-out prompts)"
run $PY -m training.smoke_check served --target "$T" --url "127.0.0.1:$P_GRPC" \
  --prompts "$WORK/prompts.jsonl" --prompts "$WORK/heldout.jsonl" --n 4 --max-new-tokens 32

step "train-smoke passed in $((SECONDS - T0)) s (work directory $WORK)"
