#!/usr/bin/env bash
# The flow-stage study on the demo target, sized for one GPU (an H200 ran it in ~9 min; on two
# CPU cores it is a day): self-distillation data, the flow stage with the new recipe and with
# one suspect of issue 17 changed at a time (all warm-started from checkpoints/demo-dflash),
# flow-map distillation of two teachers, an equal-compute DFlash-style baseline from the same
# start, and the controlled joint-structure task. Every flow run logs its flow check
# (flow_summary.json). Results: $RES (small files) and exported checkpoints under $RES/ckpt.
#
#   RES=runs/flow-study bash training/run_flow_study.sh          # DEVICE=cuda by default
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-python3}"
DEVICE="${DEVICE:-cuda}"
T=checkpoints/demo-target
RES="${RES:-runs/flow-study}"
WORK="${WORK:-$RES/work}"
S_FLOW="${STEPS_FLOW:-2000}"
S_MAP="${STEPS_DISTILL:-1000}"
LR="${LR_FLOW:-3e-4}"
PROMPTS="${PROMPTS:-training/data/drafter_prompts.jsonl}"
HELDOUT="${HELDOUT:-training/data/heldout_prompts.jsonl}"
mkdir -p "$RES" "$WORK"
stamp() { echo "[$(date +%T)] $*"; }

# The controlled task runs beside everything else (small models: CPU cores or the GPU).
JOINT=0
if [ "${JOINT_TASK:-1}" = 1 ]; then
    $PY -m training.joint_task --device "$DEVICE" --out "$RES/joint_task.md" --workdir "$WORK/joint" \
        > "$RES/joint_task.log" 2>&1 &
    JOINT=$!
fi

stamp data
$PY -m training.drafter_data --target $T --prompts "$HELDOUT" --out "$WORK/heldout" --max-new-tokens 96 \
    --device "$DEVICE" --slots 48 ${DATA_LIMIT:+--limit $DATA_LIMIT} > "$RES/data_heldout.log" 2>&1 &
HELD=$!
$PY -m training.drafter_data --target $T --prompts "$PROMPTS" --out "$WORK/data" --max-new-tokens 96 \
    --device "$DEVICE" --slots 64 ${DATA_LIMIT:+--limit $DATA_LIMIT} > "$RES/data.log" 2>&1
wait $HELD
stamp data done

common=(--small --batch-size 64 --anchors-per-seq 8 --target $T --data "$WORK/data" --device "$DEVICE" --no-progress
        --save-every "${SAVE_EVERY:-500}" --log-every 50 --check-data "$WORK/heldout" --check-prior checkpoints/demo-dflash)
flow() {  # flow NAME ARGS...: one flow-stage run from the DFlash-style start
    local name=$1; shift
    $PY -m training.train_drafter --stage flow "${common[@]}" --init-from checkpoints/demo-dflash --steps "$S_FLOW" \
        --lr "$LR" --out "$WORK/$name" "$@" > "$RES/$name.log" 2>&1
}
stamp flow grid
flow recipe &                                            # embedded map, whitened input, noise per slot, no tau = 0 mass
flow mix-map --time-map-candidates 2 0 &                # embedded map, half of it for a two-candidate reader
flow vocab-map --time-map vocab &
flow shared-noise --noise shared &
flow rms-input --state-input rms &
flow pure-noise --pure-noise-fraction 0.3 &
flow old-recipe --time-map vocab --state-input rms --noise shared --pure-noise-fraction 0.3 --lr 1e-4 &
$PY -m training.train_drafter --stage flow "${common[@]}" --dim 256 --n-blocks 2 --n-heads 4 --steps "$S_FLOW" \
    --lr 1e-3 --out "$WORK/scratch" > "$RES/scratch.log" 2>&1 &   # no warm start
wait $(jobs -p | grep -v "^$JOINT$")
stamp flow grid done
for d in "$WORK"/*/; do n=$(basename "$d"); [ -f "$d/flow_summary.json" ] && cp "$d/flow_summary.json" "$RES/$n.flow_summary.json"; [ -f "$d/loss.csv" ] && cp "$d/loss.csv" "$RES/$n.loss.csv"; done

stamp distill + baseline
$PY -m training.train_drafter --stage distill "${common[@]}" --teacher "$WORK/recipe" --steps "$S_MAP" --lr 5e-5 \
    --out "$WORK/recipe-map" > "$RES/recipe-map.log" 2>&1 &
$PY -m training.train_drafter --stage distill "${common[@]}" --teacher "$WORK/mix-map" --steps "$S_MAP" --lr 5e-5 \
    --out "$WORK/mix-map-map" > "$RES/mix-map-map.log" 2>&1 &
$PY -m training.train_drafter --stage dflash "${common[@]}" --init-from checkpoints/demo-dflash \
    --steps $((S_FLOW + S_MAP)) --lr "$LR" --out "$WORK/dflash" > "$RES/dflash.log" 2>&1 &
wait $(jobs -p | grep -v "^$JOINT$")
stamp distill + baseline done
mkdir -p "$RES/ckpt"
for r in recipe recipe-map mix-map mix-map-map dflash vocab-map old-recipe scratch; do
    [ -f "$WORK/$r/model.safetensors" ] && $PY -m training.export_drafter "$WORK/$r" "$RES/ckpt/$r" > /dev/null 2>&1
done
for d in "$WORK"/*/; do n=$(basename "$d"); [ -f "$d/loss.csv" ] && cp "$d/loss.csv" "$RES/$n.loss.csv"; done
[ "$JOINT" != 0 ] && wait $JOINT
stamp all done
