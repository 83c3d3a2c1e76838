#!/usr/bin/env bash
# TRACE RL on Slurm: Megatron trainer nodes + SGLang FP4 rollout nodes in one allocation.
#
#   sbatch scripts/run_qwen_72b.sh                      # Qwen2.5-72B, 16 nodes x 8 GPUs (below)
#   sbatch --nodes 8 --time 12:00:00 scripts/run_qwen_72b.sh --config configs/qwen2.5_72b.yaml
#   bash scripts/run_qwen_72b.sh --nodes 16             # outside a job: submits itself with sbatch
#   bash scripts/run_qwen_72b.sh --dry-run --nodes 16   # print the plan and the commands, run nothing
#   ... -- trainer.steps=100 algo.loss=tis               # config overrides for every step
#
# The plan: trainer nodes = ceil(TP*PP*DP / GPUS_PER_NODE) (first in the node list), rollout nodes =
# the rest, GPUS_PER_NODE/SGLANG_TP SGLang servers on each (one `srun --exact` step per server). The
# trainer is one `srun` step running torchrun on every trainer node (c10d rendezvous on the first),
# handed the server URLs and a fresh API key. SIGUSR1 (sent --signal's lead time before the time
# limit) or a preemption SIGTERM stop the steps and requeue the job; a requeued job resumes from
# <run_dir>/checkpoints/latest. Logs: <run_dir>/logs/, TensorBoard events: <run_dir>/.
#
# Overrides: flags (--config, --run-dir, --nodes, --dry-run) or env vars: CONFIG, RUN_DIR, NODES,
# GPUS_PER_NODE, DP, TRAINER_NODES, ROLLOUT_NODES, SERVERS_PER_NODE, SGLANG_TP (default:
# cluster.sglang_tp), ROLLOUT_BACKEND (sglang|local), TRANSPORT, SERVER_PORT, ROUTER_PORT,
# RDZV_PORT, TB_PORT, API_KEY, PYTHON, ROUTER (auto|0), TENSORBOARD (auto|0), SERVER_TIMEOUT,
# REQUEUE_ON_TERM (1: requeue on any SIGTERM), SGLANG_EXTRA_ARGS (appended to every server),
# SERVER_MEM (per-server step memory, default: the job's memory per node / servers per node).
# CPU_MODE=1 runs the tiny config on CPUs (local engine server, gloo trainer, HTTP weight sync):
#   CONFIG=configs/tiny_cpu.yaml CPU_MODE=1 GPUS_PER_NODE=0 ROLLOUT_NODES=0 sbatch --nodes 1 scripts/run_qwen_72b.sh
#
#SBATCH --job-name=trace-qwen72b
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=%x-%j.out
#SBATCH --requeue
#SBATCH --signal=B:USR1@600
set -euo pipefail

# -- arguments ----------------------------------------------------------------------------------
DRY_RUN=${DRY_RUN:-0}
OVERRIDES=()
ARGS=("$@")
while (($#)); do
  case $1 in
    --dry-run) DRY_RUN=1 ;;
    --nodes) NODES=$2; shift ;;
    --config) CONFIG=$2; shift ;;
    --run-dir) RUN_DIR=$2; shift ;;
    --) shift; OVERRIDES+=("$@"); break ;;
    *=*) OVERRIDES+=("$1") ;;
    -h|--help) awk 'NR > 1 && /^#SBATCH/ {exit} NR > 1' "$0"; exit 0 ;;
    *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." 2>/dev/null && pwd || true)
if [[ -n $here && -d $here/megatron_trace ]]; then ROOT=$here; else ROOT=${SLURM_SUBMIT_DIR:-$PWD}; fi
cd "$ROOT"
CONFIG=${CONFIG:-configs/qwen2.5_72b.yaml}
CPU_MODE=${CPU_MODE:-0}
if [[ -z ${PYTHON:-} ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
TORCHRUN=${TORCHRUN:-$(dirname "$PYTHON")/torchrun}
[[ -x $TORCHRUN ]] || TORCHRUN=torchrun

# Outside a job (and not a dry run): submit this script, flags become sbatch options.
if [[ -z ${SLURM_JOB_ID:-} && $DRY_RUN == 0 ]]; then
  exec sbatch ${NODES:+--nodes "$NODES"} "$0" "${ARGS[@]}"
fi

# -- the run config, resolved by the project's own loader ----------------------------------------
resolved=$(CPU_MODE=${CPU_MODE:-0} "$PYTHON" - "$CONFIG" "${OVERRIDES[@]}" <<'EOF'
import os, shlex, sys
from megatron_trace.config import Config
cfg = Config.load(sys.argv[1], sys.argv[2:])
q, g, r, t = cfg.quant, cfg.guidance, cfg.rollout, cfg.trainer
quant = "" if "bf16" in (q.format, q.weights) else (q.format if q.activations == "fp4" else f"w4a16_{q.format}")
from megatron_trace.perf.memory import shape_and_arch
_, source, arch = shape_and_arch(cfg)
if arch is None:
    sys.exit(f"model.path={cfg.model.path!r}: {source}: cannot resolve the quantization policy")
pol = cfg.quant.resolve(arch)  # the launch's one resolution (kv=auto: the family's K and V formats)
kv = pol.k_format if pol.k_format == pol.v_format else f"K:{pol.k_format}+V:{pol.v_format}"
per_side = pol.k_format != pol.v_format or "fp8" in (pol.k_format, pol.v_format)
if per_side and cfg.rollout.backend == "http" and os.environ.get("CPU_MODE") != "1":
    # the plugin's per-side KV method (sglang_backend/plugin/kv_sides.py) is read through torch_native
    print(f"note: quant.kv_k={pol.k_format} / quant.kv_v={pol.v_format}: SGLang servers read K and V through the "
          "plugin's per-side KV method with --attention-backend torch_native (slower than the GPU backends)",
          file=sys.stderr)
if not isinstance(g.layers, (int, str)):
    sys.exit(f"guidance.layers={g.layers!r}: servers take last_half|all|none|N")
vals = {"TP": t.tp, "PP": t.pp, "CFG_SGLANG_TP": cfg.cluster.sglang_tp, "CFG_GPUS": cfg.cluster.gpus_per_node,
        "KV_K": pol.k_format, "KV_V": pol.v_format, "KV_K_DEBIAS": "1" if pol.kv_k_debias else "",
        "QUANT": quant, "KV": kv, "GUIDE_MODE": g.mode,
        "GUIDE_LAYERS": g.layers, "ROLLOUT_DTYPE": r.dtype,
        "MAX_RUNNING": r.max_running, "SEED": t.seed, "CFG_RUN_DIR": cfg.logging.run_dir,
        "CFG_MODEL": cfg.model.path, "CFG_TRANSPORT": cfg.transfer.transport}
for k, v in vals.items():
    print(f"{k}={shlex.quote(str(v))}")
EOF
) || { echo "error: cannot load $CONFIG with ${PYTHON} (${OVERRIDES[*]:-no overrides})" >&2; exit 2; }
eval "$resolved"

RUN_DIR=${RUN_DIR:-$CFG_RUN_DIR}
[[ $RUN_DIR == /* ]] || RUN_DIR=$ROOT/$RUN_DIR
LOG_DIR=$RUN_DIR/logs
if [[ $CPU_MODE == 1 ]]; then
  GPUS_PER_NODE=${GPUS_PER_NODE:-0}; ROLLOUT_BACKEND=${ROLLOUT_BACKEND:-local}; TRANSPORT=${TRANSPORT:-http}
else
  GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_PER_NODE:-${CFG_GPUS/#0/8}}}
  ROLLOUT_BACKEND=${ROLLOUT_BACKEND:-sglang}; TRANSPORT=${TRANSPORT:-$CFG_TRANSPORT}
fi
GPUS_PER_NODE=${GPUS_PER_NODE%%(*}   # SLURM_GPUS_PER_NODE may read "8(x2)" or "gpu:8"
GPUS_PER_NODE=${GPUS_PER_NODE##*:}
SGLANG_TP=${SGLANG_TP:-$CFG_SGLANG_TP}
DP=${DP:-1}
# The trainer's per-rank memory plan (megatron_trace/perf/memory.py): printed; against cluster.gpu a
# plan that does not fit stops here, naming the knob to turn.
"$PYTHON" -m megatron_trace.perf.memory --config "$CONFIG" --dp "$DP" "${OVERRIDES[@]}" \
  || { echo "error: the trainer memory plan above does not fit (see the knob it names)" >&2; exit 2; }
SERVER_PORT=${SERVER_PORT:-30000}; ROUTER_PORT=${ROUTER_PORT:-29900}
RDZV_PORT=${RDZV_PORT:-29500}; TB_PORT=${TB_PORT:-6006}
# SGLang receives weights into CUDA tensors: NCCL on GPUs; the CPU embedded server speaks gloo.
if [[ $CPU_MODE == 1 ]]; then GROUP_BACKEND=gloo; else GROUP_BACKEND=${GROUP_BACKEND:-nccl}; fi
SERVER_TIMEOUT=${SERVER_TIMEOUT:-1800}

# -- nodes ---------------------------------------------------------------------------------------
if [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
  mapfile -t ALL_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
else  # dry run outside a job: placeholder names
  mapfile -t ALL_NODES < <(for ((i = 1; i <= ${NODES:-16}; i++)); do printf 'node%03d\n' "$i"; done)
fi
N_NODES=${#ALL_NODES[@]}
WORLD=$((TP * PP * DP))
if [[ $CPU_MODE == 1 ]]; then
  NPROC=${NPROC:-$WORLD}
  TRAINER_NODES=${TRAINER_NODES:-1}
  ROLLOUT_NODES=${ROLLOUT_NODES:-$((N_NODES - TRAINER_NODES))}
  SERVERS_PER_NODE=${SERVERS_PER_NODE:-1}
else
  ((GPUS_PER_NODE > 0)) || { echo "error: GPUS_PER_NODE=0 needs CPU_MODE=1" >&2; exit 2; }
  NPROC=$((WORLD < GPUS_PER_NODE ? WORLD : GPUS_PER_NODE))
  TRAINER_NODES=${TRAINER_NODES:-$(((WORLD + GPUS_PER_NODE - 1) / GPUS_PER_NODE))}
  ROLLOUT_NODES=${ROLLOUT_NODES:-$((N_NODES - TRAINER_NODES))}
  SERVERS_PER_NODE=${SERVERS_PER_NODE:-$((GPUS_PER_NODE / SGLANG_TP))}
  ((NPROC * TRAINER_NODES == WORLD)) || { echo "error: TP*PP*DP=$WORLD does not fill $TRAINER_NODES nodes x $GPUS_PER_NODE GPUs" >&2; exit 2; }
  ((ROLLOUT_NODES > 0 && SERVERS_PER_NODE > 0)) || { echo "error: no rollout GPUs left: $N_NODES nodes, $TRAINER_NODES for the trainer, SGLANG_TP=$SGLANG_TP" >&2; exit 2; }
fi
((TRAINER_NODES + ROLLOUT_NODES <= N_NODES)) || { echo "error: need $TRAINER_NODES trainer + $ROLLOUT_NODES rollout nodes; the allocation has $N_NODES" >&2; exit 2; }
TRAINER_HOSTS=("${ALL_NODES[@]:0:TRAINER_NODES}")
if ((ROLLOUT_NODES > 0)); then ROLLOUT_HOSTS=("${ALL_NODES[@]:TRAINER_NODES:ROLLOUT_NODES}"); else ROLLOUT_HOSTS=("${TRAINER_HOSTS[0]}"); fi
MASTER=${TRAINER_HOSTS[0]}

if [[ $DRY_RUN == 1 ]]; then API_KEY=${API_KEY:-'<API_KEY>'}; else API_KEY=${API_KEY:-$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')}; fi
# Step options: GPU steps take their GPUs and a share of the CPUs (and of the memory, when the
# cluster tracks it: CR_Core_Memory) with --exact; CPU steps share the node (--overlap).
CPUS_ON_NODE=${SLURM_CPUS_ON_NODE:-64}
if [[ -z ${SERVER_MEM:-} && -n ${SLURM_MEM_PER_NODE:-} ]]; then SERVER_MEM=$((SLURM_MEM_PER_NODE / SERVERS_PER_NODE)); fi
if [[ $CPU_MODE == 1 ]]; then
  SERVER_GRES=(--overlap); TRAINER_GRES=(--overlap)
else
  SERVER_GRES=(--exact --gres="gpu:$SGLANG_TP" --cpus-per-task=$((CPUS_ON_NODE / SERVERS_PER_NODE)) ${SERVER_MEM:+--mem="$SERVER_MEM"})
  TRAINER_GRES=(--exact --gres="gpu:$GPUS_PER_NODE" --cpus-per-task="$CPUS_ON_NODE")
fi

# -- helpers -------------------------------------------------------------------------------------
show() {  # print a command so that it can be pasted back into a shell
  local out="" w
  for w in "$@"; do
    w=${w//"$API_KEY"/<API_KEY>}  # keys stay out of logs
    if [[ $w =~ ^[][A-Za-z0-9_./:=,@%+-]+$ ]]; then out+="$w "; else out+="'${w//\'/\'\\\'\'}' "; fi
  done
  echo "  \$ ${out% }"
}
PIDS=()
launch() {  # launch LOG CMD...: background step (dry run: print it)
  local log=$1; shift
  show "$@"
  [[ $DRY_RUN == 1 ]] && return 0
  "$@" >"$log" 2>&1 &
  PIDS+=($!)
}
# shellcheck disable=SC2329  # stop_steps and on_signal run from traps
stop_steps() {  # SIGTERM to every step's tasks, STOP_GRACE s to exit, then srun ends the rest
  local p s deadline=$((SECONDS + ${STOP_GRACE:-30}))
  ((${#PIDS[@]})) || return 0
  [[ -z ${TB_PID:-} ]] || kill -TERM "$TB_PID" 2>/dev/null || true
  for s in $(squeue -h -s -j "$SLURM_JOB_ID" -o %i 2>/dev/null); do  # a SIGTERM to srun itself SIGKILLs
    [[ ! $s =~ \.[0-9]+$ ]] || scancel --signal=TERM "$s" 2>/dev/null || true
  done
  for p in "${PIDS[@]}"; do
    while kill -0 "$p" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
    kill -TERM "$p" 2>/dev/null || true
  done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=()
}
REQUEUE=0
# shellcheck disable=SC2329
on_signal() {
  if [[ $1 == USR1 ]] && ((SECONDS < 120)); then  # --time shorter than the --signal lead: don't loop
    echo "[$(date +%T)] SIGUSR1 right at the start (time limit < --signal lead time): ignored" >&2; return 0
  fi
  echo "[$(date +%T)] got SIG$1: stopping the steps" >&2
  if [[ $1 == USR1 || ${REQUEUE_ON_TERM:-0} == 1 ]] \
     || scontrol show job "$SLURM_JOB_ID" -o 2>/dev/null | grep -q 'PREEMPT'; then REQUEUE=1; fi
  stop_steps
  if ((REQUEUE)); then
    echo "[$(date +%T)] requeueing job $SLURM_JOB_ID; it resumes from $RUN_DIR/checkpoints/latest" >&2
    scontrol requeue "$SLURM_JOB_ID" || true
  fi
  exit 143
}
wait_health() {  # wait_health URL PID: until /health answers 200, the step dies, or the timeout
  local url=$1 pid=$2 deadline=$((SECONDS + SERVER_TIMEOUT))
  until curl -sf -o /dev/null -m 5 "$url/health"; do
    kill -0 "$pid" 2>/dev/null || { echo "error: the server step for $url exited; see $LOG_DIR" >&2; return 1; }
    ((SECONDS < deadline)) || { echo "error: $url not healthy after ${SERVER_TIMEOUT}s" >&2; return 1; }
    sleep 1
  done
}

# -- the plan ------------------------------------------------------------------------------------
echo "== TRACE RL plan: $CONFIG (${OVERRIDES[*]:-no overrides}) =="
echo "allocation: $N_NODES nodes (${ALL_NODES[*]}), $GPUS_PER_NODE GPUs/node, job ${SLURM_JOB_ID:-<none: dry run>}"
echo "trainer: $TRAINER_NODES nodes (${TRAINER_HOSTS[*]}), TP=$TP PP=$PP DP=$DP = $WORLD ranks ($NPROC per node), rendezvous $MASTER:$RDZV_PORT"
N_SERVERS=$((${#ROLLOUT_HOSTS[@]} * SERVERS_PER_NODE))
echo "rollout: $ROLLOUT_NODES nodes (${ROLLOUT_HOSTS[*]}), $N_SERVERS servers ($SERVERS_PER_NODE/node, SGLang TP=$SGLANG_TP, backend $ROLLOUT_BACKEND), ports $SERVER_PORT..$((SERVER_PORT + SERVERS_PER_NODE - 1))"
echo "rollout numerics: quantization=${QUANT:-bf16} kv=$KV guidance=$GUIDE_MODE on layers $GUIDE_LAYERS; weight sync: $TRANSPORT"
echo "run dir: $RUN_DIR (logs: $LOG_DIR)"

[[ $DRY_RUN == 1 ]] || { mkdir -p "$LOG_DIR"; trap 'on_signal USR1' USR1; trap 'on_signal TERM' TERM; trap stop_steps EXIT; }

# 1. the starting checkpoint (CPU mode's tiny model is built by a warm-start step)
MODEL_PATH=$CFG_MODEL
if [[ -z $MODEL_PATH ]]; then
  echo "[$(date +%T)] -- warm start (model.path is empty: build the tiny model first)"
  ws=(srun --nodes 1 --ntasks 1 -w "$MASTER" "${TRAINER_GRES[@]}" "$PYTHON" -m megatron_trace.run.warm_start
      --config "$CONFIG" "${OVERRIDES[@]}" "logging.run_dir=$RUN_DIR")
  show "${ws[@]}"
  if [[ $DRY_RUN == 1 ]]; then MODEL_PATH='<warm start dir>'; else
    MODEL_PATH=$("${ws[@]}" 2>"$LOG_DIR/warm_start.log" | tail -n 1) || true
    [[ -f $MODEL_PATH/config.json ]] || { echo "error: warm start failed; see $LOG_DIR/warm_start.log" >&2; exit 1; }
  fi
fi

# 2. rollout servers, one Slurm step each
echo "[$(date +%T)] -- rollout servers"
URLS=(); SERVER_PIDS=()
read -r -a extra <<<"${SGLANG_EXTRA_ARGS:-}"
[[ $ROLLOUT_BACKEND == sglang ]] && extra=(--tp-size "$SGLANG_TP" "${extra[@]}")
i=0
for node in "${ROLLOUT_HOSTS[@]}"; do
  for ((k = 0; k < SERVERS_PER_NODE; k++)); do
    port=$((SERVER_PORT + k)); url="http://$node:$port"
    launch "$LOG_DIR/server_$i.log" srun --nodes 1 --ntasks 1 -w "$node" "${SERVER_GRES[@]}" --job-name "rollout$i" \
      "$PYTHON" -m sglang_backend.launch --backend "$ROLLOUT_BACKEND" --model-path "$MODEL_PATH" \
      --host 0.0.0.0 --port "$port" --api-key "$API_KEY" ${QUANT:+--quantization "$QUANT"} \
      --kv-k "$KV_K" --kv-v "$KV_V" ${KV_K_DEBIAS:+--kv-k-debias} --dtype "$ROLLOUT_DTYPE" \
      --guidance-mode "$GUIDE_MODE" --guided-layers "$GUIDE_LAYERS" \
      --max-running-requests "$MAX_RUNNING" --random-seed $((SEED + i)) "${extra[@]}"
    URLS+=("$url"); ((${#PIDS[@]})) && SERVER_PIDS+=("${PIDS[-1]}"); i=$((i + 1))
  done
done
URL_LIST=$(IFS=,; echo "[${URLS[*]}]")
if [[ $CPU_MODE != 1 && ${ROUTER:-auto} != 0 ]] && "$PYTHON" -c 'import sglang_router' 2>/dev/null; then
  # The router fronts generation for outside clients (eval, chat); the trainer talks to every
  # server itself because weight updates must reach each one, not one picked by the router.
  echo "[$(date +%T)] -- sglang_router in front of the servers: http://${ROLLOUT_HOSTS[0]}:$ROUTER_PORT"
  launch "$LOG_DIR/router.log" srun --nodes 1 --ntasks 1 -w "${ROLLOUT_HOSTS[0]}" --overlap \
    "$PYTHON" -m sglang_router.launch_router --host 0.0.0.0 --port "$ROUTER_PORT" --api-key "$API_KEY" --worker-urls "${URLS[@]}"
elif [[ $CPU_MODE != 1 ]]; then
  echo "   (no sglang_router: the trainer balances over the server URLs itself)"
fi
if [[ $DRY_RUN != 1 ]]; then
  for ((j = 0; j < ${#URLS[@]}; j++)); do wait_health "${URLS[j]}" "${SERVER_PIDS[j]}"; done
  echo "[$(date +%T)] ${#URLS[@]} rollout servers healthy"
fi

# 3. TensorBoard on the batch node
echo "[$(date +%T)] -- TensorBoard"
TB_BIN=$(dirname "$PYTHON")/tensorboard; [[ -x $TB_BIN ]] || TB_BIN=tensorboard
TB=("$TB_BIN" --logdir "$RUN_DIR" --bind_all --port "$TB_PORT")
if [[ ${TENSORBOARD:-auto} != 0 ]] && command -v "$TB_BIN" >/dev/null; then
  launch "$LOG_DIR/tensorboard.log" "${TB[@]}"
  ((${#PIDS[@]} == 0)) || TB_PID=${PIDS[-1]}
  echo "   TensorBoard: http://${SLURMD_NODENAME:-$MASTER}:$TB_PORT"
else
  echo "   not started here; run:"; show "${TB[@]}"
fi

# 4. the trainer: torchrun on every trainer node
echo "[$(date +%T)] -- trainer"
RESUME=()
[[ -e $RUN_DIR/checkpoints/latest ]] && RESUME=(--resume) && echo "   resuming from $RUN_DIR/checkpoints/latest (restart ${SLURM_RESTART_COUNT:-0})"
trainer=(srun --nodes "$TRAINER_NODES" --ntasks "$TRAINER_NODES" --ntasks-per-node 1 -w "$(IFS=,; echo "${TRAINER_HOSTS[*]}")"
  "${TRAINER_GRES[@]}" --kill-on-bad-exit=1 --job-name trainer
  "$TORCHRUN" --nnodes "$TRAINER_NODES" --nproc-per-node "$NPROC" --rdzv-backend c10d
  --rdzv-endpoint "$MASTER:$RDZV_PORT" --rdzv-id "${SLURM_JOB_ID:-dry}"
  -m megatron_trace.train --config "$CONFIG" "${RESUME[@]}" "${OVERRIDES[@]}" "model.path=$MODEL_PATH"
  rollout.backend=http "rollout.urls=$URL_LIST" "rollout.api_key=$API_KEY" "transfer.transport=$TRANSPORT"
  transfer.master_address=auto "transfer.group_backend=$GROUP_BACKEND" "logging.run_dir=$RUN_DIR")
show "${trainer[@]}"
[[ $DRY_RUN == 1 ]] && exit 0
"${trainer[@]}" > >(tee -a "$LOG_DIR/trainer.log") 2>&1 &
PIDS+=($!)
rc=0; wait "${PIDS[-1]}" || rc=$?

# 5. the rollout side's final weight version (the trainer pushes one per step)
for url in "${URLS[@]}"; do
  info=$(curl -sf -m 10 -H "Authorization: Bearer $API_KEY" "$url/model_info" || true)
  ver=$(sed -n 's/.*"weight_version": *"\{0,1\}\([^",}]*\).*/\1/p' <<<"$info")
  echo "rollout server $url weight_version=${ver:-unknown}" | tee -a "$LOG_DIR/rollout_versions.txt"
done
echo "[$(date +%T)] trainer exited with $rc"
exit "$rc"
