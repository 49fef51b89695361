#!/usr/bin/env bash
# Kills worker 1 of plain-sync launches (2 shards, 2 workers, pieces of PIECE KiB) at random
# moments; for each run: the chief's message, the shards' take-backs, and whether the chief's
# checkpoint is bitwise the one-process run's at that step.
T=${TOWERS_BIN:-build/towers}
R=${R:-10}; W=${W:-/tmp/take-back}; mkdir -p $W
common="--model mlp --dataset synthetic --synthetic-size 1000 --batch 16 --seed 5 --eval-every 0 --checkpoint-every 0.5 --threads-per-tower 1 --mode sync --optimizer adam --lr 0.001"
for ((i=0;i<R;i++)); do
  out=$W/$i; rm -rf $out
  $T launch --ps 2 --workers 2 --out $out -- train $common --steps 2000 --log-every 1 --rpc-timeout 60 --heartbeat-timeout 2 --rpc-piece-kib ${PIECE:-1} --checkpoint-dir $out/ck > $W/$i.log 2>&1 &
  l=$!
  while ! grep -qs '"event":"step"' $out/worker-1.jsonl; do sleep 0.05; done
  sleep 0.$((RANDOM % 10))$((RANDOM % 10))
  kill -9 $(python3 -c "import json;print([p['pid'] for p in json.load(open('$out/processes.json')) if p['task']=='worker:1'][0])")
  wait $l; rc=$?
  msg=$(grep -o 'the last complete round, step [0-9]*\|no round completed.*\|could not be read.*' $W/$i.log | head -1)
  step=$(echo "$msg" | grep -o 'step [0-9]*' | grep -o '[0-9]*')
  same=-
  if [[ -n $step ]]; then
    rm -rf $W/one; $T train $common --towers 2 --steps $step --log-every 1000 --quiet --checkpoint-dir $W/one >/dev/null 2>&1
    same=$(python3 - "$out/ck" "$W/one" "$step" <<'PY'
import json,struct,sys
def load(p):
    b=open(p,'rb').read(); n=struct.unpack('<Q',b[:8])[0]; h=json.loads(b[8:8+n]); d=b[8+n:]
    return {k:d[v['data_offsets'][0]:v['data_offsets'][1]] for k,v in h.items() if k!='__metadata__'}, h.get('__metadata__')
s=int(sys.argv[3]); f=f"ckpt-{s:09d}.safetensors"
a,ma=load(f"{sys.argv[1]}/{f}"); b,mb=load(f"{sys.argv[2]}/{f}")
print("bitwise" if a==b and ma.get('step')==mb.get('step') else "DIFFERENT")
PY
)
  fi
  echo "run $i rc=$rc: $msg [$same]"
  grep -h "taken back" $out/ps-*.log | sed 's/^/   /'
done
