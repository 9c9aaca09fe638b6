#!/bin/bash
cd /work/main
exec 9>/tmp/cpu-heavy.lock; flock 9
RAY_AUTH_MODE=disabled setsid .venv/bin/serve run --address local config/demo.yaml > /tmp/cpushare/serve.log 2>&1 9>&- &
SPID=$!
for i in $(seq 1 300); do
  a=$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/v1/models); [ "$a" = 200 ] && break; sleep 2
done
echo "ready after $i polls"; sleep 20
ps -eo pid,times,args --no-headers > /tmp/cpushare/before.txt; head -1 /proc/stat > /tmp/cpushare/stat-before.txt; T0=$(date +%s.%N)
/usr/bin/time -f "client cpu user %U sys %S wall %e" .venv/bin/python -m loadtest.race --mode chat --dataset sharegpt --ours http://127.0.0.1:8000 --peer http://127.0.0.1:8000 \
  --rates 2 --num-prompts 40 --out /tmp/cpushare/race 9>&- > /tmp/cpushare/race.log 2>&1 &
RPID=$!
sleep 1; echo "client pid $RPID"; echo $RPID > /tmp/cpushare/client.pid
wait $RPID
ps -eo pid,times,args --no-headers > /tmp/cpushare/after.txt; head -1 /proc/stat > /tmp/cpushare/stat-after.txt; T1=$(date +%s.%N)
echo "window $(echo "$T1 - $T0" | bc) s"
curl -s http://127.0.0.1:8000/debug/engine > /tmp/cpushare/debug.json
kill -TERM -- -$SPID; sleep 15; kill -KILL -- -$SPID 2>/dev/null
echo done
