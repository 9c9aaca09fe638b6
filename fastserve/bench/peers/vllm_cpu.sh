#!/usr/bin/env bash
# Start the vLLM CPU peer (set up by ../shared/peers/vllm-cpu/setup.sh under $VLLMCPU) on ANY model
# folder, at vLLM's defaults as a user runs it:
#   vllm serve FOLDER --host 127.0.0.1 --port PORT --dtype DTYPE --served-model-name NAME
# (no --max-model-len, no --enforce-eager: the folder's context and vLLM's own choices).
# The shared start_server.sh hard-codes $VLLMCPU/opt125m-dummy; this is the same launcher with the
# folder a knob. Stop it with $VLLMCPU/scripts/stop_server.sh (PID in $VLLMCPU/server.pid), or, for a
# second server started with PIDFILE=..., kill -TERM -- -$(cat PIDFILE) (its own process group).
#
# Knobs (env): MODEL (folder, default the demo's SmolLM2 folder), NAME (default smollm2-135m-instruct),
#   PORT (8100), DTYPE (float32 | bfloat16; bfloat16 only where /proc/cpuinfo has avx512_bf16 or amx_bf16),
#   VLLM_CPU_KVCACHE_SPACE (GiB, 4), VLLM_CPU_OMP_THREADS_BIND, EXTRA_ARGS, LOG, PIDFILE ($VLLMCPU/server.pid).
set -u
D=${VLLMCPU:?set VLLMCPU to the folder setup.sh installed vLLM into}
REPO=$(cd "$(dirname "$0")/../../.." && pwd)
MODEL=${MODEL:-$REPO/.cache/models/smollm2-135m-instruct}
NAME=${NAME:-smollm2-135m-instruct}
PORT=${PORT:-8100}
DTYPE=${DTYPE:-float32}
LOG=${LOG:-$D/logs/server-$NAME-$DTYPE.log}
PIDFILE=${PIDFILE:-$D/server.pid}
MODEL=$(readlink -f "$MODEL")
[ -f "$MODEL/config.json" ] || { echo "no config.json in $MODEL"; exit 1; }
if [ "$DTYPE" = bfloat16 ] && ! grep -q -m1 -E 'avx512_bf16|amx_bf16' /proc/cpuinfo; then
  echo "warning: this CPU has no avx512_bf16/amx_bf16; vLLM's bfloat16 will be several times slower" >&2
fi
mkdir -p $D/logs $D/cache $D/tmp
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export HF_HOME=$D/cache/hf VLLM_CACHE_ROOT=$D/cache/vllm TMPDIR=$D/tmp
export VLLM_TARGET_DEVICE=cpu VLLM_HOST_IP=127.0.0.1
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
[ -n "${VLLM_CPU_OMP_THREADS_BIND:-}" ] && export VLLM_CPU_OMP_THREADS_BIND
T0=$(date +%s.%N)
setsid $D/venv/bin/python $D/scripts/vllm_cli.py serve "$MODEL" \
  --host 127.0.0.1 --port $PORT --dtype $DTYPE --served-model-name "$NAME" ${EXTRA_ARGS:-} \
  > "$LOG" 2>&1 < /dev/null &
PID=$!
echo $PID > "$PIDFILE"
echo "server pid $PID ($MODEL as $NAME, $DTYPE), log $LOG"
for i in $(seq 1 900); do
  if curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:$PORT/health 2>/dev/null | grep -q 200; then
    T1=$(date +%s.%N); echo "ready after $(echo "$T1 - $T0" | bc) s"
    ps -o rss= -g $PID | awk '{s+=$1} END {printf "process-group RSS at ready: %.0f MiB\n", s/1024}'
    exit 0
  fi
  if ! kill -0 $PID 2>/dev/null; then echo "server died"; tail -40 "$LOG"; exit 1; fi
  sleep 1
done
echo "timeout waiting for server"; exit 1
