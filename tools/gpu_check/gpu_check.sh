#!/usr/bin/env bash
# One prepared GPU check for one H200 (Python 3.12, torch 2.11, no network): 590 s by its own accounting (the
# machine's start not counted), compilation included: under 10 minutes, so the call and a rerun of the sections that
# failed (GPU_CHECK_SECTIONS) fit a 15-minute lease. Sections,
# in the order of what only a GPU can answer, each in its own process under its own time limit (the limits add up
# to the budget), each result written into $RESULTS/bench.json as the section ends, and a training section's steps
# after each step (tools/gpu_check/gpu_check_sections.py; a failed or timed-out section records its status and
# error, and the next runs). Limits: docs/benchmarks.md ("GPU check: sections and limits") gives the evidence for each.
#   env              the blocker below is active, imports, versions, the AutocastCUDA registrations and (GPU) the
#                    real per-op autocast dtypes, saved at once (compared with nagmoe's CPU stand-in offline:
#                    python -m nagmoe.cuda_rules.probe --mode tier --rules 2.11 --compare bench.json)
#   data             script-made token shards at the paper vocabulary (no network, no `datasets`)
#   train_nag,       configs/paper/{nag,baseline,nag-mod20}-r40.yaml at EP=1 through the real Trainer, one section
#   train_baseline,  each, compiled (inductor's caches shared on disk: the later sections reuse the first one's
#   train_nag_mod20  kernels), 65536-token batches, 8 steps: tokens/s, MFU (data sheet and a measured bf16 matmul),
#                    peak memory vs the committed estimate (tools/gpu_check/gpu_check_estimates.json), host
#                    syncs per step and their sites, losses, MoD's realised skip; the summary adds NAG / baseline
#                    step time and MoD's wall-clock gain vs its FLOP gain; a warning off sm90/sm100 (_grouped_mm's
#                    fast path). A failed compile is recorded, then the config runs eager in a fresh process
#   mod_speed        issues 59, 69: MoD against NAG in one process (tools/gpu_check/gpu_check_mod.py). The first
#                    GPU run found NAG+MoD-20% 33x slower than NAG (gather MoD); static MoD (model.mod.impl, the
#                    CUDA default) skips the expert GEMMs only. nag-r40, then nag-mod20-r40 with the compute dial
#                    at skip rates 0, 0.2, 0.5 (settled, then pinned), 8 timed steps each: MoD/NAG step ratio, the MoE
#                    sublayers' own skip, saved = 1 - step(rate)/step(0) against skip x share (the eligible
#                    sublayers; the expert GEMMs alone: 0.9 of it at 0.2 is issue 59's bar), new graphs and graph
#                    breaks, host reads (SyncCounter; GPU: a step under sync debug mode "error"), peak memory, a
#                    kernel table per rate (mod_speed_profile_<rate>.txt)
#   profile          issue 60: baseline-r40 and nag-r40 through the Trainer at the paper's 131,072 tokens per
#                    optimizer step: 3 warm steps, 3 timed (CUDA events: step, micro-steps, the optimizer apart), MFU
#                    against the data sheet beside the training section's, and one profiled step: time and kernel
#                    launches by region (attention, MoE GEMMs, MoE glue, loss, optimizer, stream; GPU idle), the
#                    grouped GEMM's TFLOP/s, the kernel table (profile_<config>_<variant>.txt); the `before` variant
#                    runs the switches that restore the code before issue 60 (tools/gpu_check/gpu_check_profile.py)
#   resume           a 4-layer nag-mod20-r40 saved and resumed through the Trainer: losses match the straight run
#   tests            tests/gpu/ (gpu-marked)
#   dcp              a DCP checkpoint of this torch read back through the restricted unpickler (.metadata kept)
#   install          pip install --no-deps --no-build-isolation --use-pep517 --no-index -e . (GPU mode only; the
#                    other sections import the package from the checkout)
# Each limit is also capped by what is left of the script's budget (GPU_CHECK_BUDGET seconds: 590, --lease 325,
# --cpu 285, --cpu --lease 145); the summary prints each section's seconds against its limit.
# The packages the GPU image lacks (datasets, wandb, deepspeed, transformers, lm_eval, flash_attn, megablocks,
# grouped_gemm) are missing for every Python process (each meta-path finder wrapped in a temporary sitecustomize):
# `import` raises ModuleNotFoundError and importlib.util.find_spec returns None, as on the GPU machine.
# tests/perf/test_gpu_check_rehearsal.py runs this script in GPU mode on a stand-in GPU host (CPU only).
#
#   tools/gpu_check/gpu_check.sh            # on the GPU machine
#   tools/gpu_check/gpu_check.sh --lease    # one 15-minute lease (issue 69): env, data, train_nag, train_nag_mod20,
#                                           # mod_speed in 325 s, so the machine's start and a whole rerun fit beside it
#   tools/gpu_check/gpu_check.sh --cpu      # CI: the same sections at tiny size on CPU (no install), in bf16 under
#                                           # CUDA's autocast rules of torch 2.11 (NAGMOE_CUDA_RULES,
#                                           # nagmoe/cuda_rules); with --lease the lease's list
# Results: $GPU_CHECK_OUT (default: $OUT if set, else a temporary folder): bench.json, gpu_check.log (every
# section's output), the DCP .metadata. Run dirs, data and compile caches live in a scratch folder removed at the end.
# On request only (GPU_CHECK_SECTIONS=mod_block): mod_block, the MoD block benchmark (tools/bench/bench_mod.py --block,
# issue 28) at the paper's 16-row micro-batch; mod_speed answers its question through the Trainer.
# Test hooks: GPU_CHECK_SECTIONS=a,b (only those), GPU_CHECK_FAIL=name (that section fails at its start),
# GPU_CHECK_HANG=name (it hangs until its limit), GPU_CHECK_LIMIT_<name>=seconds (another limit).
# GPU_CHECK_BUDGET and GPU_CHECK_LIMIT_* must be whole seconds: anything else stops the script at once with one line
# and exit 2, before it runs anything (bash arithmetic would abort on `1.5` or run the command in `x[$(cmd)]`).
set -u
MODE=gpu PLAN=full
for arg in "$@"; do
  case $arg in
    --cpu) MODE=cpu ;;
    --lease) PLAN=lease ;;
    *) echo "usage: tools/gpu_check/gpu_check.sh [--cpu] [--lease]" >&2; exit 2 ;;
  esac
done
for var in GPU_CHECK_BUDGET $(compgen -v GPU_CHECK_LIMIT_); do  # names only: compgen lists variable names
  if [[ -n "${!var:-}" && ! ${!var} =~ ^[0-9]{1,6}$ ]]; then
    printf 'tools/gpu_check/gpu_check.sh: %s=%q must be a whole number of seconds\n' "$var" "${!var:0:60}" >&2; exit 2
  fi
done
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)" || exit 1  # tools/gpu_check/ -> the checkout
cd "$REPO" || exit 1
PY="${PYTHON:-python3}"
RESULTS="${GPU_CHECK_OUT:-${OUT:-$(mktemp -d)}}"
mkdir -p "$RESULTS"
BLOCK="$(mktemp -d)"
WORK="$(mktemp -d)"
trap 'rm -rf "$BLOCK" "$WORK"' EXIT

# -- the import blocker ------------------------------------------------------------------------------------
cat > "$BLOCK/sitecustomize.py" <<'PYEOF'
import sys

_HIDDEN = ("datasets", "wandb", "deepspeed", "transformers", "lm_eval", "flash_attn", "megablocks", "grouped_gemm")


class _Without:
    """One finder of sys.meta_path that does not find the packages of _HIDDEN: with every finder wrapped, they are
    missing as on the GPU machine (`import` raises ModuleNotFoundError, importlib.util.find_spec returns None)."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _HIDDEN:
            return None
        find = getattr(self._finder, "find_spec", None)
        return None if find is None else find(name, path, target)

    def __getattr__(self, attr):  # invalidate_caches and the rest: the finder's own
        return getattr(self._finder, attr)


sys.meta_path[:] = [_Without(f) for f in sys.meta_path]
PYEOF
export PYTHONPATH="$BLOCK:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
if [[ $MODE == cpu ]]; then
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" CUDA_VISIBLE_DEVICES=""
  # CUDA's autocast rules of the GPU machine's torch on the CPU (bf16; nagmoe/cuda_rules): every section's Trainer
  # meets the dtypes the GPU run will meet. NAGMOE_CUDA_RULES= (empty) runs plain fp32.
  export NAGMOE_CUDA_RULES="${NAGMOE_CUDA_RULES-2.11}"
  FULL_BUDGET=285 LEASE_BUDGET=145
  SECTIONS=(env:15 data:15 train_nag:30 train_baseline:25 train_nag_mod20:25 mod_speed:60 profile:45 resume:35 tests:20
            dcp:15)
  LEASE=(env:15 data:15 train_nag:30 train_nag_mod20:25 mod_speed:60)  # --lease (rehearsed in CI)
  ON_REQUEST=(mod_block:20)  # run only when GPU_CHECK_SECTIONS names them (after the listed ones)
else
  FULL_BUDGET=590  # + at most 5 s of a last kill and the summary: under 10 minutes
  # measured on the H200 (docs/benchmarks.md): env 18 s, data 3, train_nag 65 cold (42 s compile), train_baseline
  # 40 with the caches, train_nag_mod20 13 s a step once MoD skips (gather; static MoD is meant to step near NAG's
  # time), tests 51, dcp 9-11, install 11. mod_speed (not yet measured): 44 steps with the caches, 4 eager counted
  # steps, 4 under sync debug mode, 3 profiles: in this list's 80 s the profiles that would not fit are skipped and
  # said so (the lease list gives it 150). profile (not yet measured): 2 configs x 2
  # variants x 7 steps of 131,072 tokens (~0.8 s each), a compile each (the caches; `before`'s CCA conv unit new)
  SECTIONS=(env:30 data:10 train_nag:90 train_baseline:55 train_nag_mod20:45 mod_speed:80 profile:120 resume:55 tests:60
            dcp:20 install:25)
  # --lease (issue 69): what a 15-minute lease needs answered, in 325 s; with the machine's start (1-2 min) a rerun
  # of the whole list still fits (docs/benchmarks.md). mod_speed (not yet measured): NAG 2 + 8 steps, MoD 2 + 8 +
  # 2 x (4 settling + 8) steps (~0.4 s each on the training sections' caches), 4 eager counted steps, 3 profiles
  LEASE_BUDGET=325
  LEASE=(env:30 data:10 train_nag:90 train_nag_mod20:45 mod_speed:150)
  ON_REQUEST=(mod_block:45)  # run only when GPU_CHECK_SECTIONS names them (after the listed ones)
fi
DEFAULT_BUDGET=$FULL_BUDGET
if [[ $PLAN == lease ]]; then SECTIONS=("${LEASE[@]}") DEFAULT_BUDGET=$LEASE_BUDGET; fi
BUDGET=$((10#${GPU_CHECK_BUDGET:-$DEFAULT_BUDGET}))  # 10#: 08 is eight, not an octal error
# compiled kernels shared between the section processes (inductor's FX graph and Triton caches)
export TORCHINDUCTOR_CACHE_DIR="$WORK/inductor" TRITON_CACHE_DIR="$WORK/triton"
DRIVER=("$PY" "$REPO/tools/gpu_check/gpu_check_sections.py")
LOG="$RESULTS/gpu_check.log"
: > "$LOG"
"${DRIVER[@]}" init --out "$RESULTS" --mode "$MODE" --budget "$BUDGET" || exit 1

FAILED=0
run_section() {  # name, limit in seconds
  local name=$1 limit=$2
  local custom="GPU_CHECK_LIMIT_$name"
  limit=$((10#${!custom:-$limit}))  # checked at the start
  local left=$((BUDGET - SECONDS))
  if (( left < 5 )); then
    "${DRIVER[@]}" record "$name" --out "$RESULTS" --status timeout --seconds 0 --limit 0 \
      --error "not started: the script's ${BUDGET} s budget is spent"
    echo "== $name: not started (budget spent)"; FAILED=1; return
  fi
  (( limit > left )) && limit=$left
  local part="$WORK/$name.log" t0=$SECONDS
  timeout --kill-after=5 "$limit" "${DRIVER[@]}" run "$name" --out "$RESULTS" --work "$WORK" --mode "$MODE" \
    --limit "$limit" > "$part" 2>&1
  local rc=$? secs=$((SECONDS - t0))
  # a killed or crashed process could not write its own end: the shell does (only over a "running" status)
  if (( rc == 124 || rc == 137 )); then
    "${DRIVER[@]}" record "$name" --out "$RESULTS" --status timeout --seconds "$secs" --limit "$limit" \
      --error "killed at its ${limit} s limit"
  elif (( rc != 0 )); then
    "${DRIVER[@]}" record "$name" --out "$RESULTS" --status failed --seconds "$secs" --limit "$limit" \
      --error "exited $rc: $(tail -n 1 "$part" | cut -c1-300)"
  fi
  { echo "== $name (exit $rc, ${secs} s)"; cat "$part"; } >> "$LOG"
  echo "== $name: exit $rc (${secs} s)"
  if (( rc != 0 )); then tail -n 15 "$part"; FAILED=1; fi
}

for entry in "${SECTIONS[@]}"; do
  name=${entry%%:*}
  if [[ -n "${GPU_CHECK_SECTIONS:-}" && ",$GPU_CHECK_SECTIONS," != *",$name,"* ]]; then continue; fi
  run_section "$name" "${entry##*:}"
done
for entry in "${ON_REQUEST[@]}"; do  # outside the budget's default list: only by name
  name=${entry%%:*}
  if [[ ",${GPU_CHECK_SECTIONS:-}," == *",$name,"* ]]; then run_section "$name" "${entry##*:}"; fi
done
"${DRIVER[@]}" summary --out "$RESULTS" | tee -a "$LOG"
exit "$FAILED"
