#!/usr/bin/env bash
# The demo pipeline on CPU, every stage resumable (rerun the script to continue):
# target -> drafter training prompts -> self-distillation data -> FlashMap flow -> flow-map
# distillation -> DFlash-style and EAGLE-style baselines -> evaluation report.
# Sizes are the CPU presets; STEPS_* override them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
T=checkpoints/demo-target
RUNS="${RUNS:-runs/demo}"
ARCH="--dim 256 --n-blocks 2 --n-heads 4"

[ -f "$T/model.safetensors" ] || $PY -m training.train_target --out "$T"
[ -f training/data/drafter_prompts.jsonl ] || $PY -m training.drafter_prompts --per-domain "${PROMPTS_PER_DOMAIN:-300}"
$PY -m training.drafter_data --target "$T" --prompts training/data/drafter_prompts.jsonl --out "$RUNS/data" \
    --max-new-tokens "${MAX_NEW:-96}" --temperature 0
$PY -m training.train_drafter --stage flow --small $ARCH --pure-noise-fraction "${PURE_NOISE:-0.3}" --steps "${STEPS_FLOW:-1200}" --target "$T" --data "$RUNS/data" --out "$RUNS/flow" --resume &
$PY -m training.train_drafter --stage dflash --small $ARCH --steps "${STEPS_DFLASH:-1500}" --target "$T" --data "$RUNS/data" --out "$RUNS/dflash" --resume &
wait
$PY -m training.train_drafter --stage distill --small --steps "${STEPS_DISTILL:-400}" --teacher "$RUNS/flow" --target "$T" --data "$RUNS/data" --out "$RUNS/map" --resume &
$PY -m training.train_eagle --small --steps "${STEPS_EAGLE:-1500}" --target "$T" --data "$RUNS/data" --out "$RUNS/eagle" --resume &
wait
$PY -m flashmap.cli eval --target "$T" --flashmap "$RUNS/map" --teacher "$RUNS/flow" --dflash "$RUNS/dflash" \
    --eagle "$RUNS/eagle" --max-prompts "${EVAL_PROMPTS:-6}" --max-new-tokens "${EVAL_NEW:-64}" --threads 1
