#!/usr/bin/env bash
# One prepared GPU check (<= 4 minutes on one H200), every section under its own timeout:
#   install (pip install --no-deps --no-build-isolation -e ., nothing else) -> environment -> the gpu-marked
#   tests (tests/gpu/, by path) -> a DCP checkpoint of this torch read back through the restricted unpickler
#   (its .metadata kept under the results) -> benchmarks at the paper width, 4 layers (tools/bench_suite.py
#   --device cuda --paper-width: tokens/s, MFU, NAG overhead, MoD speed-up, peak memory) -> one summary table.
# Eager by default (the fused NAG update is one of the measured variants); synthetic data only.
# `datasets`, `wandb` and `deepspeed` are hidden from every Python process (a meta-path blocker in a temporary
# sitecustomize), as on the GPU machine, which has none of them: an import of one at import time fails here.
#
#   tools/gpu_check.sh            # on the GPU machine
#   tools/gpu_check.sh --cpu      # smoke mode (CI): the same sections at tiny sizes, no install
# Results: $GPU_CHECK_OUT (default: $OUT if set, else a temporary folder): one log per section, bench.json.
set -u
MODE=gpu
if [[ "${1:-}" == "--cpu" ]]; then MODE=cpu; elif [[ $# -gt 0 ]]; then
  echo "usage: tools/gpu_check.sh [--cpu]" >&2; exit 2
fi
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
RESULTS="${GPU_CHECK_OUT:-${OUT:-$(mktemp -d)}}"
mkdir -p "$RESULTS"
BLOCK="$(mktemp -d)"
trap 'rm -rf "$BLOCK"' EXIT

# -- the import blocker ------------------------------------------------------------------------------------
cat > "$BLOCK/sitecustomize.py" <<'PYEOF'
import sys

_HIDDEN = ("datasets", "wandb", "deepspeed")


class _Hide:
    """Makes `import datasets|wandb|deepspeed` fail as on a machine without them."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _HIDDEN:
            raise ImportError(f"{name} is hidden by tools/gpu_check.sh (absent on the GPU machine)")
        return None


sys.meta_path.insert(0, _Hide())
PYEOF
export PYTHONPATH="$BLOCK:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
if [[ $MODE == cpu ]]; then
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" CUDA_VISIBLE_DEVICES=""
fi

declare -a SUMMARY
run_section() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" > "$RESULTS/$name.log" 2>&1
  local rc=$?
  local status=ok
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then status="TIMEOUT (${limit}s)"; elif [[ $rc -ne 0 ]]; then status="FAILED rc=$rc"; fi
  SUMMARY+=("$(printf '%-10s %-18s %4ss' "$name" "$status" $((SECONDS - t0)))")
  echo "== $name: $status ($((SECONDS - t0)) s); log $RESULTS/$name.log"
  [[ $status == ok ]] || tail -n 25 "$RESULTS/$name.log"
  return $rc
}

# -- sections ----------------------------------------------------------------------------------------------
if [[ $MODE == gpu ]]; then
  run_section install 90 "$PY" -m pip install --no-deps --no-build-isolation -e . || true
fi
run_section env 30 "$PY" - <<'PYEOF' || true
import importlib.util, torch
for hidden in ("datasets", "wandb", "deepspeed"):
    try:
        __import__(hidden)
        raise SystemExit(f"{hidden} imported: the blocker is not active")
    except ImportError:
        pass
import nagmoe.model, nagmoe.ops.nag_fused, nagmoe.train.trainer, nagmoe.flops  # noqa: E401 (import check)
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
print("triton", importlib.util.find_spec("triton") is not None)
PYEOF
cat "$RESULTS/env.log"
run_section tests 100 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/ || true
tail -n 3 "$RESULTS/tests.log"
# A DCP checkpoint written by this machine's torch (2.11 on the GPU machine), read back through the restricted
# unpickler; its .metadata lands in $RESULTS/dcp_checkpoint/ to become a test fixture (issue 21).
run_section dcp_metadata 60 "$PY" - "$RESULTS/dcp_checkpoint" <<'PYEOF' || true
import shutil, sys, torch
from nagmoe.checkpoint import load_checkpoint, save_checkpoint
from nagmoe.checkpoint.safe_dcp import read_metadata_file
from nagmoe.model import build_model
from nagmoe.config import load_config
cfg = load_config("configs/tiny.yaml", ["model.d_model=32", "model.n_layers=1", "model.vocab_size=256"])
model = build_model(cfg.model)
optim = torch.optim.AdamW(model.parameters())
model(torch.randint(0, 256, (1, 16)), torch.randint(0, 256, (1, 16))).loss.backward()
optim.step()
shutil.rmtree(sys.argv[1], ignore_errors=True)
path = save_checkpoint(sys.argv[1], 1, model, optim)
read_metadata_file(path + "/.metadata")
fresh = build_model(cfg.model)
load_checkpoint(path, fresh, torch.optim.AdamW(fresh.parameters()), restore_rng=False)
print("torch", torch.__version__, "metadata read back through the allow-list:", path)
PYEOF
if [[ $MODE == gpu ]]; then
  BENCH=(--device cuda --paper-width --sections nag,moe,mod,mfu)
  BENCH_LIMIT=170
else
  BENCH=(--smoke --sections nag,moe,mfu --nag-variants baseline,nag_eager,mod)
  BENCH_LIMIT=150
fi
run_section bench "$BENCH_LIMIT" "$PY" tools/bench_suite.py "${BENCH[@]}" --out "$RESULTS/bench.json" || true

# -- summary -----------------------------------------------------------------------------------------------
echo
echo "== summary ($MODE mode; results in $RESULTS)"
printf '%s\n' "${SUMMARY[@]}"
if [[ -f "$RESULTS/bench.json" ]]; then
  "$PY" - "$RESULTS/bench.json" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
n = r.get("nag", {})
base = n.get("baseline", {})
print(f"\n| variant | tokens/s | step s | peak memory MB (CPU: step RSS) | time / baseline | memory / baseline |")
print("|---|---|---|---|---|---|")
for name in ("baseline", "nag_eager", "nag_fused", "mod"):
    v = n.get(name)
    if v:
        mem = v.get("cuda_max_allocated_bytes", v["step_peak_bytes"]) / 2**20
        print(f"| {name} | {v['tokens_per_s']:.0f} | {v['min_s']:.4f} | {mem:.0f} | "
              f"{v.get('time_ratio', 1.0):.3f} | {v.get('memory_ratio', 1.0):.3f} |")
m = r.get("mfu")
if m:
    sheet = m.get("mfu_vs_datasheet")
    print(f"\nMFU: {100 * m['mfu_vs_measured_matmul']:.1f}% of the measured matmul "
          f"({m['matmul_flops_per_s'] / 1e12:.1f} TFLOP/s); data-sheet: "
          + (f"{100 * sheet:.1f}%" if sheet else "N/A"))
if "mod" in n:
    print(f"MoD-20% speed-up over full depth (NAG eager): {n['mod']['mod_speedup']:.3f}")
moe = r.get("moe")
if moe:
    print("MoE loop / grouped: " + ", ".join(f"{E} experts {moe[f'experts_{E}']['loop_over_grouped']:.2f}x"
                                             for E in (8, 32, 64)))
for g in r.get("goals", {}).values():
    print(f"goal: {g['goal']}: {g['value']:.3f} {'met' if g['met'] else 'NOT met'}")
PYEOF
fi
for line in "${SUMMARY[@]}"; do
  [[ $line == *FAILED* || $line == *TIMEOUT* ]] && exit 1
done
exit 0
