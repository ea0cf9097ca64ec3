#!/usr/bin/env bash
# The GPU measurement of sync.method=cuda_ipc on one GPU, as run: correctness test, bench_sync (cuda_ipc vs a
# device-to-device copy), and the deepspeed colocated step's sync (cuda_ipc vs ray).
#   CARRY=<dir with rlspec-*.whl, the serve wheels and test_cuda_ipc.py> bash gpu_sync_measure.sh   ($OUT set;
#   .devicepkgs carried, run from the project root of the GPU machine's copy)
ROOT=$PWD
source .devicepkgs/install.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$CARRY"/*.whl > $OUT/install.log 2>&1
cd /tmp  # not the project root: its ./rlspec (a source tree) would shadow the installed package
python -c "import rlspec.spec, rlspec.serve.app, fastapi, uvicorn, httpx, deepspeed, ray; print('imports ok', rlspec.__file__)" >> $OUT/install.log 2>&1
nvidia-smi -L >> $OUT/install.log
echo "== pytest" > $OUT/results.txt
timeout 120 python -m pytest -q -p no:cacheprovider "$CARRY"/test_cuda_ipc.py -x 2>&1 | tail -15 >> $OUT/results.txt
echo "== bench_sync cuda_ipc" >> $OUT/results.txt
timeout 150 python -m rlspec.bench_sync --method cuda_ipc --repeats 5 --json $OUT/bench_cuda_ipc.json >> $OUT/results.txt 2>&1
for m in cuda_ipc ray; do
  echo "== deepspeed colocated $m" >> $OUT/results.txt
  timeout 200 python -m rlspec.cli run $ROOT/examples/tiny.yaml --backend deepspeed model=qwen2_0p5b_shape hardware=gpu1 \
    sync.method=$m algorithm.steps=3 rollout.max_new_tokens=16 checkpoint.save_optimizer=false \
    --out /tmp/ds_$m --no-progress > $OUT/ds_$m.log 2>&1
  echo "exit $?" >> $OUT/results.txt
  python - "$m" >> $OUT/results.txt 2>&1 <<'PY'
import json, sys
for r in map(json.loads, open(f"/tmp/ds_{sys.argv[1]}/metrics.jsonl")):
    print({k: r[k] for k in ("step", "timing_s/sync", "sync/bytes", "sync/gb_per_s", "timing_s/step", "timing_s/gen", "timing_s/train")})
PY
done
tail -5 $OUT/ds_cuda_ipc.log >> $OUT/results.txt
