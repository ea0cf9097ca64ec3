#!/usr/bin/env bash
# measure.sh: the GPU measurements quoted in docs/ and the backends' READMEs, run on the GPU machine (no network).
#
# Usage, from the project root, with `.devicepkgs` carried (../shared/device/README.md: ray, deepspeed, hydra; under
# .devicepkgs/extra the wheels `bash tests/gpu/pack_extra.sh` downloads: the serve stack, the openai client, TRL):
#   OUT=<dir> bash tests/gpu/measure.sh SECTION...
# Each section writes its logs and metrics under $OUT; $OUT/results.txt collects the lines worth reading and
# $OUT/all.tgz everything (both refreshed after every section, and after every row of the multi-GPU sections, so a
# call cut short keeps what it finished). Sections are listed in the `case` below, each with a comment saying what
# it measures and its knobs. The main kinds:
#   one GPU, the step beside TRL's GRPOTrainer:      OUT=o bash tests/gpu/measure.sh trl32 trl64
#   one GPU, where the engine's or trainer's time goes: OUT=o bash tests/gpu/measure.sh engine profile
#   several GPUs, strong and weak scaling with per-rank traces (issue 54):
#     OUT=o ROWS="fsdp:1:64 fsdp:2:64 deepspeed:1:64 deepspeed:2:64" bash tests/gpu/measure.sh scale
#   several GPUs, the layouts of issue 44, one part per 10-minute call:  OUT=o bash tests/gpu/measure.sh multigpu_a
#   the server under concurrent clients:              OUT=o bash tests/gpu/measure.sh servechat
#   faults and a soak on several GPUs (tests/gpu/faults.py, one call each): OUT=o bash tests/gpu/measure.sh faults
#   multi-turn agents beside a plain rollout (issue 56):  OUT=o bash tests/gpu/measure.sh agents_multiturn
#   evaluation's cost beside the rollout (issue 55):        OUT=o bash tests/gpu/measure.sh eval
#   the GPU-marked tests:                            OUT=o bash tests/gpu/measure.sh gputests
#
# Knobs (environment), with their defaults:
#   OUT (required)        where results go
#   CUDA_VISIBLE_DEVICES  the GPUs this call may use; one-GPU sections take the first of them
#   MG_GPUS="1 2 4"       the GPU counts of the multigpu_* rows (rows needing more GPUs than there are say so)
#   ROWS                  the scale section's rows: backend:gpus:prompts per GPU[:override...]
#   MEASURE_TMP=/tmp      scratch folder; MEASURE_INSTALLED=1 skips installing (another measure.sh of the call did)
#   EXTRA, BACKENDS, P, VARIANTS, ...  per-section knobs, named in the section's comment
# Several at once on one machine, each on GPUs of its own (at most one of them with Ray):
#   OUT=$OUT/i bash tests/gpu/measure.sh install; export MEASURE_INSTALLED=1
#   (CUDA_VISIBLE_DEVICES=0,1 MEASURE_TMP=/tmp/m01 MG_GPUS=2 OUT=$OUT/mg bash tests/gpu/measure.sh multigpu_a) &
#   (CUDA_VISIBLE_DEVICES=2 MEASURE_TMP=/tmp/m2 OUT=$OUT/sc bash tests/gpu/measure.sh servechat) & wait
# A figure in docs/ names the commit it was measured at: re-run it as it was from that commit (defaults, kernels and
# budgets change between commits; the commit messages say which).
set -u
ROOT=$PWD
FINAL=${OUT:?set OUT}; mkdir -p "$FINAL"  # a new subfolder of the device tool's $OUT is made here
# everything lands here, emptied first (a warm machine keeps the last call's); $FINAL gets results.txt and all.tgz
# Several measure.sh may run at once on one machine, each on GPUs of its own (CUDA_VISIBLE_DEVICES): each then
# takes a scratch folder of its own (MEASURE_TMP, default /tmp), and all but the first MEASURE_INSTALLED=1 (the
# first installs; see the multigpu parts' note below)
SCRATCH=${MEASURE_TMP:-/tmp}; mkdir -p $SCRATCH
ONE=${CUDA_VISIBLE_DEVICES:-0}; ONE=${ONE%%,*}  # the one-GPU sections run on the first GPU this call may use
OUT=$SCRATCH/measure; rm -rf $OUT; mkdir -p $OUT
source .devicepkgs/install.sh
if [ -n "${MEASURE_INSTALLED:-}" ]; then
  :  # another measure.sh of this call installed rlspec and the extras
elif ! ls .devicepkgs/extra/*.whl > /dev/null 2>&1; then
  # without them the server's GPU tests fail on a missing uvicorn and the TRL rows cannot run
  echo "no .devicepkgs/extra: run 'bash tests/gpu/pack_extra.sh' here before the call (serve stack, openai, TRL)" \
    | tee -a $OUT/results.txt
elif [ ! -f /tmp/site/.extra ]; then  # a warm machine keeps these from the last call
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .devicepkgs/extra/*.whl > $OUT/install.log 2>&1 \
    && touch /tmp/site/.extra
fi
# rlspec itself every call: the working tree changes between calls
if [ -z "${MEASURE_INSTALLED:-}" ]; then
  rm -rf /tmp/site/rlspec /tmp/site/rlspec-*.dist-info build  # a warm machine's build/ would reinstall the last call's files
  python3 -m pip install -q --no-deps --no-build-isolation --upgrade --target /tmp/site . >> $OUT/install.log 2>&1
fi
nvidia-smi -L >> $OUT/install.log
cd /tmp  # not the project root: its ./rlspec (a source tree) would shadow the installed package
RL="python3 -m rlspec.cli"
BENCH=$ROOT/examples/bench_qwen0p5b.yaml

keep() {  # copy a bench's per-backend metrics next to its log, as they are (bench.json comes only at the end)
  local name=$1 dir=$2
  for m in $dir/*/metrics.jsonl; do [ -f "$m" ] && cp "$m" "$OUT/${name}_$(basename $(dirname $m)).jsonl"; done
  [ -f $dir/bench.json ] && cp $dir/bench.json $OUT/${name}_bench.json
}

NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
[ -n "${CUDA_VISIBLE_DEVICES:-}" ] && NGPU=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
mg_done() {  # the multigpu table so far, and everything copied out (kept if the call is cut short)
  python3 $ROOT/tests/gpu/multigpu_table.py $OUT > $OUT/multigpu_table.txt 2>&1
  cp $OUT/results.txt $OUT/multigpu_table.txt $FINAL/; tar -czf $FINAL/all.tgz -C $OUT .
}
mg_limit() {  # a bench row's timeout on N GPUs: the 1-GPU row took 142 s on an H100; three rows + install < 9 min
  case $1 in 1) echo 160 ;; 2) echo 170 ;; *) echo 185 ;; esac
}
mg_bench() {  # ROW GPUS TIMEOUT_S BACKEND SPEC [OVERRIDES...]: one bench row of the multigpu table
  local row=$1 need=$2 limit=$3 be=$4; shift 4
  if [ $NGPU -lt $need ]; then echo "$row: skipped, needs $need GPUs ($NGPU here)" >> $OUT/results.txt; return; fi
  timeout $limit $RL bench "$@" --backends $be --out $SCRATCH/b_mg_$row > $OUT/mg_$row.log 2>&1
  echo $? > $OUT/mg_$row.exit
  cp $SCRATCH/b_mg_$row/$be/plan.json $OUT/mg_${row}_plan.json 2>/dev/null
  echo "$row exit $(cat $OUT/mg_$row.exit)" >> $OUT/results.txt; grep -m3 "Error\|error:" $OUT/mg_$row.log >> $OUT/results.txt
  keep mg_$row $SCRATCH/b_mg_$row; mg_done
}
mg_push() {  # ROW GPUS BENCH_SYNC_ARGS...: one push row (the 7B shape, fsdp ranks and Ray engines); every rank's
  # push window traced (rlspec.perf.rank_trace): the 7th push, bench_sync's untimed first one without verification,
  # so the timed medians are not the profiler's; rank 0's Chrome trace too
  local row=$1 need=$2; shift 2
  if [ $NGPU -lt $need ]; then echo "push $row: skipped, needs $need GPUs ($NGPU here)" >> $OUT/results.txt; return; fi
  RLSPEC_RANK_TRACE=$OUT/trace_push_$row RLSPEC_RANK_TRACE_CALL=6 RLSPEC_RANK_TRACE_CHROME=1 \
    timeout 150 python3 -m rlspec.perf.bench_sync --backend fsdp --model qwen2_7b_shape --repeats 5 "$@" \
    --json $OUT/mg_push_$row.json > $OUT/mg_push_$row.log 2>&1
  echo "push $row exit $?" >> $OUT/results.txt; sed -n "/(median of/,\$p" $OUT/mg_push_$row.log | grep -v -i warn | head -40 >> $OUT/results.txt
  python3 -m rlspec.perf.rank_trace $OUT/trace_push_$row >> $OUT/results.txt 2>&1; mg_done
}
sections=$(echo "$@" | sed 's/\bmultigpu\b/multigpu_a multigpu_b multigpu_c multigpu_d multigpu_e multigpu_f multigpu_g/')

for section in $sections; do
  start=$(date +%s)
  rm -rf $SCRATCH/b_* $SCRATCH/ds_*  # a warm machine keeps the last call's runs
  echo "== $section" >> $OUT/results.txt
  case $section in
    install)  # nothing more: rlspec and the carried packages installed (before several measure.sh run at once)
      ;;
    gputests)  # the GPU-marked tests (engine log-probs vs trainer, sampler distribution, cuda_ipc, the server);
      # GPUTESTS=<paths> runs a subset
      # From a copy of tests/ and examples/: in the project root its ./rlspec source tree would shadow the
      # installed package (the tests start `python -m rlspec.cli` subprocesses there).
      rm -rf $SCRATCH/gputests; mkdir -p $SCRATCH/gputests; cp -r $ROOT/tests $ROOT/examples $ROOT/pyproject.toml $SCRATCH/gputests/
      # Four workers on the one GPU (GPU_WORKERS=1: one at a time): one at a time the whole set ran past 300 s.
      # A test past GPU_TEST_TIMEOUT seconds (default 300) fails with every thread's stack (pytest-timeout), where
      # one that hung used to take the whole 500 s and leave no word of which it was.
      (cd $SCRATCH/gputests && timeout 500 python3 -m pytest -q -p no:cacheprovider -p no:logging -n ${GPU_WORKERS:-4} -rfEs \
        --timeout ${GPU_TEST_TIMEOUT:-300} \
        --durations=8 -m gpu ${GPUTESTS:-tests} 2>&1 | tail -40) >> $OUT/results.txt ;;
    dsync)  # issue 8: the deepspeed backend colocated on one GPU, its step's sync through cuda_ipc and through ray
      for m in cuda_ipc ray; do
        CUDA_VISIBLE_DEVICES=$ONE timeout 200 $RL run $ROOT/examples/tiny.yaml --backend deepspeed model=qwen2_0p5b_shape \
          hardware=gpu1 sync.method=$m algorithm.steps=4 rollout.max_new_tokens=16 checkpoint.every_n_steps=0 \
          checkpoint.save_optimizer=false --out $SCRATCH/ds_$m --no-progress > $OUT/dsync_$m.log 2>&1
        echo "$m exit $?" >> $OUT/results.txt; cp $SCRATCH/ds_$m/metrics.jsonl $OUT/dsync_$m.jsonl 2>/dev/null
      done ;;
    fsdp1)  # issue 7: the three backends on one GPU (all three take more than one 10-minute device call:
      # BACKENDS=standalone,deepspeed in one, BACKENDS=standalone,fsdp in the next; deepspeed@model.compile_layers=false
      # for its layers eager);
      # EXTRA=<overrides> for all of them, e.g. EXTRA=rollout.prompts_per_step=32. Issue 18's deepspeed ratios
      # (backends/deepspeed/README.md): EXTRA="algorithm.steps=6 rollout.prompts_per_step=32", then EXTRA="algorithm.steps=6"
      # with OUT set to another folder, both BACKENDS=standalone,deepspeed in one call; ZeRO-1 beside them:
      # BACKENDS="standalone,deepspeed@hardware.deepspeed.zero_stage=1,deepspeed" EXTRA="algorithm.steps=5", then with
      # rollout.prompts_per_step=32 added, one call each; fsdp's (backends/fsdp/README.md,
      # one H200): BACKENDS=standalone,fsdp with the same two EXTRA values, one call each
      CUDA_VISIBLE_DEVICES=$ONE timeout 590 $RL bench $BENCH algorithm.steps=3 ${EXTRA:-} \
        --backends ${BACKENDS:-standalone,deepspeed,fsdp} \
        --out $SCRATCH/b_fsdp1 > $OUT/fsdp1.log 2>&1; echo "exit $?" >> $OUT/results.txt
      keep fsdp1 $SCRATCH/b_fsdp1; tail -8 $OUT/fsdp1.log >> $OUT/results.txt ;;
    nccl)  # issue 8: the bridge's nccl push across 2 GPUs beside a raw broadcast of the same bytes
      timeout 200 python3 -m rlspec.perf.bench_sync --method nccl --repeats 5 --json $OUT/bench_nccl.json >> $OUT/results.txt 2>&1 ;;
    ipc)  # issue 8: cuda_ipc push on one GPU beside a device-to-device copy of the same bytes
      CUDA_VISIBLE_DEVICES=$ONE timeout 200 python3 -m rlspec.perf.bench_sync --method cuda_ipc --repeats 10 \
        --json $OUT/bench_ipc.json >> $OUT/results.txt 2>&1 ;;
    bridge)  # issue 8: standalone with its rollout server on GPU 1 (nccl bridge) beside standalone colocated on GPU 0
      for mode in separate colocated; do
        hw=$([ $mode = separate ] && echo "hardware=gpu2_separate sync.method=nccl" || echo "hardware=gpu1")
        timeout 240 $RL bench $BENCH $hw algorithm.steps=5 --backends standalone --out $SCRATCH/b_$mode > $OUT/bridge_$mode.log 2>&1
        echo "$mode exit $?" >> $OUT/results.txt; keep bridge_$mode $SCRATCH/b_$mode; tail -4 $OUT/bridge_$mode.log >> $OUT/results.txt
      done ;;
    async)  # issue 10: engine on its own GPU, nccl sync, the same spec synchronous and asynchronous
      for mode in sync async; do
        timeout 240 $RL bench $BENCH hardware=gpu2_separate sync.method=nccl algorithm.steps=6 rollout.mode=$mode \
          rollout.max_staleness=1 --backends fsdp --out $SCRATCH/b_$mode > $OUT/async_$mode.log 2>&1
        echo "$mode exit $?" >> $OUT/results.txt; keep async_$mode $SCRATCH/b_$mode; tail -4 $OUT/async_$mode.log >> $OUT/results.txt
      done ;;
    trl8|trl32|trl64)  # issue 9: the standalone engine beside TRL's GRPOTrainer, 8, 32 or 64 prompts x 8 (issue 18:
      # the train phase's MFU at 32 and 64 x 8); BACKENDS= the runs (default standalone; e.g. standalone,standalone@KEY=VALUE)
      p=${section#trl}
      CUDA_VISIBLE_DEVICES=$ONE timeout 480 $RL bench $BENCH rollout.prompts_per_step=$p --backends ${BACKENDS:-standalone} ${REFERENCE---reference trl} \
        --out $SCRATCH/b_$section > $OUT/$section.log 2>&1; echo "exit $?" >> $OUT/results.txt
      keep $section $SCRATCH/b_$section; tail -8 $OUT/$section.log >> $OUT/results.txt ;;
    engine)  # issue 9: where the engine's generation time goes (prefill, capture, decode step, kernels), per sampler variant
      CUDA_VISIBLE_DEVICES=$ONE timeout 300 python3 -m rlspec.perf.profile_engine $BENCH > $OUT/engine_8.txt 2>&1
      echo "engine 8 exit $?" >> $OUT/results.txt; grep -v "^ " $OUT/engine_8.txt | head -14 >> $OUT/results.txt
      CUDA_VISIBLE_DEVICES=$ONE timeout 200 python3 -m rlspec.perf.profile_engine $BENCH rollout.prompts_per_step=32 \
        --variants fused,fused_layers --rows 0 > $OUT/engine_32.txt 2>&1
      echo "engine 32 exit $?" >> $OUT/results.txt; head -8 $OUT/engine_32.txt >> $OUT/results.txt ;;
    longtail)  # issue 19: geometric lengths (median 100, 1,024 budget) at 32 x 8: continuous batching, the static
      # batch and TRL in one bench call (continuous with the default 256 slots and with 64), each with its length
      # histogram (response_len/*) beside its tokens/s; BACKENDS=standalone EXTRA=algorithm.steps=3: the default
      # engine and TRL only, in a shorter call
      CUDA_VISIBLE_DEVICES=$ONE timeout 590 $RL bench $ROOT/examples/bench_longtail.yaml ${EXTRA:-} \
        --backends ${BACKENDS:-standalone,standalone@rollout.decode_slots=64,standalone@rollout.continuous_batching=false} \
        ${REFERENCE---reference trl} \
        --out $SCRATCH/b_longtail > $OUT/longtail.log 2>&1; echo "exit $?" >> $OUT/results.txt
      keep longtail $SCRATCH/b_longtail; tail -20 $OUT/longtail.log >> $OUT/results.txt ;;
    decode_step)  # issue 19: the fixed 64 x 256 batch's decode step alone, for the profile_engine variants VARIANTS=...
      # (default: the default step, and the same with the work outside the decoder layers run eagerly); EXTRA=
      # overrides (a few rows: EXTRA="rollout.prompts_per_step=1 algorithm.group_size=4 algorithm.micro_batch_size=4"),
      # ROWS=30: the kernel tables
      CUDA_VISIBLE_DEVICES=$ONE timeout 200 python3 -m rlspec.perf.profile_engine $BENCH ${EXTRA:-} \
        --variants ${VARIANTS:-fused_layers_sdpa,fused_layers_sdpa_eager_ends} --rows ${ROWS:-0} > $OUT/decode_step.txt 2>&1
      echo "decode step exit $?" >> $OUT/results.txt; head -12 $OUT/decode_step.txt >> $OUT/results.txt ;;
    engine_longtail)  # issue 19: the engine alone on the long-tailed 32 x 8 batch: generate with and without continuous
      # batching (same seeds, lengths printed), then each variant's batch time, prefill, capture and decode step at the
      # default pool (the default one, and the same without the decode kernels: VARIANTS=... to change);
      # and the fixed 8 x 8 x 256 batch's decode step (no regression: 1.43 ms on the H200 before issue 19; FIXED_VARIANTS=...
      # to compare variants there too)
      CUDA_VISIBLE_DEVICES=$ONE timeout 300 python3 -m rlspec.perf.profile_engine $ROOT/examples/bench_longtail.yaml \
        --variants ${VARIANTS:-fused_layers_sdpa,fused_layers_sdpa_masked} --rows 0 > $OUT/engine_longtail.txt 2>&1
      echo "engine longtail exit $?" >> $OUT/results.txt; head -12 $OUT/engine_longtail.txt >> $OUT/results.txt
      CUDA_VISIBLE_DEVICES=$ONE timeout 200 python3 -m rlspec.perf.profile_engine $BENCH \
        --variants ${FIXED_VARIANTS:-fused_layers_sdpa} --rows 30 > $OUT/engine_fixed.txt 2>&1
      echo "engine fixed exit $?" >> $OUT/results.txt; grep -v "^ " $OUT/engine_fixed.txt | head -12 >> $OUT/results.txt ;;
    tail)  # issue 19: continuous batching's long tail, the engine alone on the long-tailed 32 x 8 batch: generate with and
      # without continuous batching, each split by pool size (steps, ms a step, captures), then each variant's batch
      # time, split too (default: the default, the default before the tail's pools halved down to 16 slots, each
      # captured ahead, and the tail never moving);
      # EXTRA=rollout.prompts_per_step=64: 64 x 8, twice the default pool, so continuous batching refills slots
      CUDA_VISIBLE_DEVICES=$ONE timeout ${LIMIT:-280} python3 -m rlspec.perf.profile_engine $ROOT/examples/bench_longtail.yaml ${EXTRA:-} \
        --variants ${VARIANTS:-fused_layers_sdpa,fused_layers_sdpa_quarter_floor1_no_ahead,fused_layers_sdpa_no_shrink} --rows 0 \
        --timeline > $OUT/tail.txt 2>&1
      echo "tail exit $?" >> $OUT/results.txt; cat $OUT/tail.txt >> $OUT/results.txt ;;
    train_ab)  # issue 18: the train phase alone, padded vs packed vs token budgets, uniform and spread lengths
      CUDA_VISIBLE_DEVICES=$ONE timeout 240 python3 -m rlspec.perf.bench_train --rows ${ROWS:-64,256} \
        --json $OUT/train_ab.json > $OUT/train_ab.txt 2>&1; echo "train_ab exit $?" >> $OUT/results.txt
      tail -20 $OUT/train_ab.txt >> $OUT/results.txt ;;
    profile)  # issue 9: where the standalone train phase spends its time (kernels, host syncs, busy share)
      for p in 8 32; do
        CUDA_VISIBLE_DEVICES=$ONE timeout 240 python3 -m rlspec.perf.profile_train $BENCH rollout.prompts_per_step=$p --steps 3 \
          > $OUT/profile_$p.txt 2>&1; echo "profile $p exit $?" >> $OUT/results.txt
      done ;;
    profile_ab)  # issue 18: the packed train phase at 32 x 8 under a 16k-token budget, eager layers against compiled ones
      # (model.compile_layers); PT_EXTRA=<overrides> adds to both; P=64: 64 prompts x 8
      for c in false true; do
        CUDA_VISIBLE_DEVICES=$ONE timeout 300 python3 -m rlspec.perf.profile_train $BENCH rollout.prompts_per_step=${P:-32} \
          algorithm.micro_batch_tokens=16384 model.compile_layers=$c ${PT_EXTRA:-} --steps 4 > $OUT/profile_ab_$c.txt 2>&1
        echo "profile compile_layers=$c exit $?" >> $OUT/results.txt; head -4 $OUT/profile_ab_$c.txt >> $OUT/results.txt
      done ;;
    trace32)  # issue 18: the packed, compiled train phase at P x 8 (default 32; BUDGET= token budget, default 16k) with
      # the last step's Chrome trace in $OUT/trace<P>.json.gz, to find where the GPU idles (STACKS=--stacks: with
      # Python stacks; EXTRA= more overrides)
      P=${P:-32}
      CUDA_VISIBLE_DEVICES=$ONE timeout 240 python3 -m rlspec.perf.profile_train $BENCH rollout.prompts_per_step=$P \
        algorithm.micro_batch_tokens=${BUDGET:-16384} model.compile_layers=true ${EXTRA:-} --steps 4 --rows 40 --trace $SCRATCH/trace$P.json ${STACKS:-} \
        > $OUT/trace$P.txt 2>&1; echo "trace$P exit $?" >> $OUT/results.txt; head -4 $OUT/trace$P.txt >> $OUT/results.txt
      gzip -c $SCRATCH/trace$P.json > $OUT/trace$P.json.gz ;;
    host)  # issue 18: the train phase's host time at P x 8 (default 32): Python's garbage collector paused in the
      # micro-batch loops (the default) or automatic, and the CUDA allocator with expandable segments; 6 steps each
      for run in automatic paused paused@expandable; do
        gcmode=${run%%@*}; alloc=""; [ "$run" != "$gcmode" ] && alloc="expandable_segments:True"
        PYTORCH_CUDA_ALLOC_CONF=$alloc CUDA_VISIBLE_DEVICES=$ONE timeout 200 python3 -m rlspec.perf.profile_train $BENCH \
          rollout.prompts_per_step=${P:-32} --gc $gcmode --steps 6 --rows 10 > $OUT/host_${gcmode}_${alloc%%:*}.txt 2>&1
        echo "host $run exit $?" >> $OUT/results.txt; head -9 $OUT/host_${gcmode}_${alloc%%:*}.txt | grep -v Warn >> $OUT/results.txt
      done ;;
    split)  # issue 18: token-budget micro-batches first-fit against evened out (the default), at P x 8 (default 32)
      # and a 32k budget, the runs interleaved
      for split in first-fit even first-fit even; do
        CUDA_VISIBLE_DEVICES=$ONE timeout 120 python3 -m rlspec.perf.profile_train $BENCH rollout.prompts_per_step=${P:-32} \
          algorithm.micro_batch_tokens=32768 --split $split --steps 6 --rows 5 > $OUT/split_$split.txt 2>&1
        echo "split $split exit $?" >> $OUT/results.txt; grep -E "train phase|peak" $OUT/split_$split.txt >> $OUT/results.txt
      done ;;
    headtrain)  # issue 18: the train phase at P x 8 (default 32) with the log-prob head's reductions torch.compile'd
      # and as Triton kernels (the default, rlspec.core.fused_head); HEADS= the runs, in order (default: compiled triton);
      # EXTRA= more overrides
      for head in ${HEADS:-compiled triton}; do
        CUDA_VISIBLE_DEVICES=$ONE timeout 240 python3 -m rlspec.perf.profile_train $BENCH rollout.prompts_per_step=${P:-32} \
          ${EXTRA:-} --head $head --steps ${STEPS:-6} --rows 8 > $OUT/headtrain_$head.txt 2>&1
        echo "headtrain $head exit $?" >> $OUT/results.txt; grep -E "train phase|peak|kernel" $OUT/headtrain_$head.txt | head -6 >> $OUT/results.txt
      done ;;
    ab)  # an A/B of one source file on the standalone train phase at P x 8 (default 32): AB_FILE=<the file, e.g.
      # rlspec/rollout/static.py> AB_OLD=<a copy of its old version in the tree>, run old, new, old, new (profile_train,
      # STEPS= steps each, default 6; EXTRA= more overrides), each run's per-step walls and allocator segments in results.txt
      i=0
      for run in old new old new; do
        i=$((i + 1)); cp $ROOT/$([ $run = old ] && echo ${AB_OLD:?} || echo ${AB_FILE:?}) /tmp/site/$AB_FILE
        CUDA_VISIBLE_DEVICES=$ONE timeout 200 python3 -m rlspec.perf.profile_train $BENCH rollout.prompts_per_step=${P:-32} \
          ${EXTRA:-} --steps ${STEPS:-6} --rows 8 > $OUT/ab_${i}_$run.txt 2>&1
        echo "ab $i $run exit $?" >> $OUT/results.txt; grep -E "train phase|segments" $OUT/ab_${i}_$run.txt >> $OUT/results.txt
      done
      cp $ROOT/$AB_FILE /tmp/site/$AB_FILE ;;
    few_kernels)  # issue 19: the decode kernels' tiles swept at the tail's few rows (ROWS=4,16), live attention's
      # parts over a 1,152-token cache there, and an empty kernel's floor; one JSON line each
      CUDA_VISIBLE_DEVICES=$ONE timeout ${LIMIT:-420} python3 -m rlspec.perf.bench_decode_kernels --few-rows ${ROWS:-4,16} \
        > $OUT/few_kernels.txt 2>&1
      echo "few_kernels exit $?" >> $OUT/results.txt; cat $OUT/few_kernels.txt >> $OUT/results.txt ;;
    decode_kernels)  # issue 19: the decode step's Triton kernels beside what they replace (split-K projections, with
      # a sweep of their tiles at 64 rows, and gate/up with its SiLU gate against cuBLAS, attention over live positions
      # against cuDNN's SDPA, the LM head with its sampling race against cuBLAS's head then the compiled race), then
      # the fixed 64 x 256 decode step with all of them and without each (profile_engine variants), with its kernel
      # table
      CUDA_VISIBLE_DEVICES=$ONE timeout 200 python3 -m rlspec.perf.bench_decode_kernels > $OUT/decode_kernels.txt 2>&1
      echo "decode_kernels exit $?" >> $OUT/results.txt; cat $OUT/decode_kernels.txt >> $OUT/results.txt
      CUDA_VISIBLE_DEVICES=$ONE timeout 200 python3 -m rlspec.perf.bench_decode_kernels --head > $OUT/sampled_head.txt 2>&1
      echo "sampled_head exit $?" >> $OUT/results.txt; cat $OUT/sampled_head.txt >> $OUT/results.txt; cp $OUT/results.txt $FINAL/
      CUDA_VISIBLE_DEVICES=$ONE timeout 300 python3 -m rlspec.perf.profile_engine $BENCH --variants ${VARIANTS:-fused_layers_sdpa,\
fused_layers_sdpa_cublas_qkv,fused_layers_sdpa_cache_write,fused_layers_sdpa_ungated,fused_layers_sdpa_logits,\
fused_layers_sdpa_cublas_head_mlp,fused_layers_sdpa_live,fused_layers_sdpa_masked} \
        --rows 40 > $OUT/engine_decode.txt 2>&1
      echo "engine decode exit $?" >> $OUT/results.txt; grep -v "^ " $OUT/engine_decode.txt | head -16 >> $OUT/results.txt ;;
    head)  # issue 18: the log-prob head at one chunk: the unfused chunk's elementwise kernels by how they are
      # compiled, beside a device copy of the same logits; a whole chunk forward and backward, unfused against the
      # Triton head (rlspec.core.fused_head), beside cuBLAS's logits GEMM; the Triton head's tile sweep
      CUDA_VISIBLE_DEVICES=$ONE timeout 240 python3 -m rlspec.perf.bench_head --sweep > $OUT/head.json 2>&1
      echo "head exit $?" >> $OUT/results.txt; cat $OUT/head.json >> $OUT/results.txt ;;
    trainers)  # issue 18: each backend's train phase on one GPU, its one rank in this process (profile_train
      # --backend: the kernel table, busy share and the last step's trace in $OUT/trainers_<run>_<P>.json.gz),
      # P prompts x 8 (default 8). RUNS= names the runs as backend[@override,...] (default: standalone, fsdp,
      # deepspeed). Figures in the READMEs: RUNS="fsdp@hardware.fsdp.gather_during_rollout=false fsdp" (the gather
      # during sampling, A/B); TORCH_LOGS=recompiles RUNS="standalone deepspeed deepspeed@hardware.deepspeed.memory_efficient_linear=true"
      # (ZeRO-3's linear inside compiled layers, and why it recompiles); RUNS="deepspeed@hardware.deepspeed.param_persistence_numel=1000000000
      # standalone deepspeed" (nothing gathered or released; at 8 x 8, and with P=32). Those ran when deepspeed's default
      # persistence was 1e5; one rank now keeps every parameter whole by default, so name the partitioned run
      # deepspeed@hardware.deepspeed.param_persistence_numel=100000 to re-run them.
      # RUNS="standalone deepspeed deepspeed@hardware.deepspeed.reduce_bucket_numel=500000000,hardware.deepspeed.prefetch_bucket_numel=0"
      # (one gradient bucket and no prefetching on one rank: within noise of the defaults, H200)
      # RUNS="standalone deepspeed@hardware.deepspeed.zero_stage=2 deepspeed" (ZeRO-2 against ZeRO-3 on one rank, H200)
      # RUNS="standalone deepspeed@hardware.deepspeed.zero_stage=1 deepspeed" (ZeRO-1 against ZeRO-3 on one rank, at P=8 and
      # P=32); RUNS="deepspeed@hardware.deepspeed.zero_stage=1,hardware.num_threads=1 deepspeed@hardware.deepspeed.zero_stage=1,model.compile_layers=false
      # standalone@hardware.num_threads=1" (the in-process rank's thread count). These ran before InProcessGroup took a
      # Ray actor's thread count (one): the default runs now measure what num_threads=1 measured then.
      for run in ${RUNS:-standalone fsdp deepspeed}; do
        b=${run%%@*}; extra=""; [ "$run" != "$b" ] && extra=$(echo ${run#*@} | tr , ' ')
        name=$(echo $run | tr '@=,.' '____')
        CUDA_VISIBLE_DEVICES=$ONE timeout 240 python3 -m rlspec.perf.profile_train $BENCH rollout.prompts_per_step=${P:-8} \
          $extra --backend $b --steps 4 --trace $SCRATCH/trainers.json > $OUT/trainers_${name}_${P:-8}.txt 2>&1
        echo "trainers $run P=${P:-8} exit $?" >> $OUT/results.txt; head -4 $OUT/trainers_${name}_${P:-8}.txt >> $OUT/results.txt
        [ -f $SCRATCH/trainers.json ] && gzip -c $SCRATCH/trainers.json > $OUT/trainers_${name}_${P:-8}.json.gz; rm -f $SCRATCH/trainers.json
        cp $OUT/results.txt $FINAL/  # kept if the call is cut short (a run takes 1.5-2.5 min: three or four fit in one call)
      done ;;
    threads)  # issue 18: the batch-packing CPU ops beside one in-process deepspeed rank (tests/gpu/probe_threads.py),
      # per ZeRO stage (STAGES=, default "1 3"). The deepspeed README's 0.25 ms under both stages ran before
      # InProcessGroup took a Ray actor's thread count (one); since then the ops after setup run on one thread.
      for stage in ${STAGES:-1 3}; do
        ROOT=$ROOT timeout 150 python3 $ROOT/tests/gpu/probe_threads.py $stage >> $OUT/threads.log 2>&1
        echo "threads stage $stage exit $?" >> $OUT/results.txt
      done
      grep -E "^stage|^  " $OUT/threads.log >> $OUT/results.txt ;;
    servechat)  # issue 45 (was issue 20's one burst): rlspec serve of the 0.5B shape under 1, 16, 64, 256 concurrent
      # streams (32-token prompts, 64 tokens each), each level beside the in-process engine's batched generate of the
      # same prompts and lengths. SC_LEVELS, SC_PROMPT, SC_OUTPUT, SC_API=chat change them; SC_ENGINE_PROCESS the
      # server's --engine-process, one sweep each, side by side (default "on off": the engine in a process of its
      # own, then in the HTTP process, the server's default), SC_TIMEOUT each sweep's limit (default 590 / count)
      eps=${SC_ENGINE_PROCESS:-on off}; n_eps=$(echo $eps | wc -w)
      for ep in $eps; do
        timeout ${SC_TIMEOUT:-$(( 590 / n_eps ))} python3 -m rlspec.perf.bench_serve $BENCH --concurrency ${SC_LEVELS:-1,16,64,256} \
          --prompt-tokens ${SC_PROMPT:-32} --output-tokens ${SC_OUTPUT:-64} --api ${SC_API:-completions} \
          --engine-process $ep --json $OUT/servechat_$ep.json > $OUT/servechat_$ep.log 2>&1
        echo "servechat --engine-process $ep exit $?" >> $OUT/results.txt
        grep -v Warning $OUT/servechat_$ep.log | tail -16 >> $OUT/results.txt
      done ;;
    serveprofile)  # issue 45: where rlspec serve's processes and threads spend 256-stream bursts (the 0.5B shape,
      # --warm-pool, --engine-process SC_ENGINE_PROCESS, default on): py-spy (from .devicepkgs/extra) samples the server,
      # its engine process included, while bench_serve --url sends SC_LEVELS (default 256,256,256); the stacks are
      # summarized per thread by tests/gpu/pyspy_top.py
      # its own folder: the extras' install into /tmp/site leaves out binaries whose bin/ exists there already
      python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy $ROOT/.devicepkgs/extra/py_spy-*.whl \
        > $OUT/pyspy_install.log 2>&1
      port=18123
      $RL serve $BENCH --port $port --warm-pool --engine-process ${SC_ENGINE_PROCESS:-on} > $OUT/serveprofile_server.log 2>&1 &
      server=$!
      python3 -c "import sys,time,urllib.request as u
for _ in range(300):
    try: u.urlopen('http://127.0.0.1:$port/health', timeout=2); sys.exit(0)
    except Exception: time.sleep(1)
sys.exit(1)"; echo "serveprofile server up: exit $?" >> $OUT/results.txt
      grep warmed $OUT/serveprofile_server.log >> $OUT/results.txt
      timeout 150 /tmp/pyspy/bin/py-spy record --pid $server --subprocesses --threads -r 500 -d 60 -f raw -o $OUT/serveprofile.txt \
        > $OUT/pyspy.log 2>&1 &
      spy=$!; sleep 2
      timeout 120 python3 -m rlspec.perf.bench_serve --url http://127.0.0.1:$port --concurrency ${SC_LEVELS:-256,256,256} \
        --prompt-tokens 32 --output-tokens 64 > $OUT/serveprofile_bench.log 2>&1
      echo "serveprofile bench exit $?" >> $OUT/results.txt; kill -INT $spy; wait $spy; kill $server; wait $server
      grep -v Warning $OUT/serveprofile_bench.log | tail -5 >> $OUT/results.txt; tail -3 $OUT/pyspy.log >> $OUT/results.txt
      python3 $ROOT/tests/gpu/pyspy_top.py $OUT/serveprofile.txt 15 >> $OUT/results.txt 2>&1 ;;
    admit)  # issue 45: the serving pool's admission alone (no server), 1, 16 and 64 rows of 32-token prompts, timed with
      # the device synced, and one 64-row admission under torch.profiler (tests/gpu/probe_admit.py)
      CUDA_VISIBLE_DEVICES=$ONE timeout 200 python3 $ROOT/tests/gpu/probe_admit.py $BENCH > $OUT/admit.txt 2>&1
      echo "admit exit $?" >> $OUT/results.txt; grep "^warm\|^rows\|^refresh\|^live\|^new" $OUT/admit.txt >> $OUT/results.txt ;;
    agents64)  # issue 45: the chat agent example (two turns of 4 tokens, a tool call between) with 64 agents at once on
      # one GPU (8 prompts x 8), beside a plain batched rollout of the same prompts and 8 tokens: generation samples/s
      # (timing_s/gen) over the steps after the first
      for mode in agent plain; do
        extra=$([ $mode = plain ] && echo "rollout.agent.function=null rollout.max_new_tokens=8" \
          || echo "rollout.agent.function=$ROOT/examples/agents/chat_tool.py:solve rollout.agent.concurrency=64")
        timeout 280 $RL run $ROOT/examples/agent_chat_tool.yaml hardware=gpu1 rollout.prompts_per_step=8 algorithm.steps=5 \
          checkpoint.every_n_steps=0 $extra --out $SCRATCH/b_agents64_$mode --no-progress > $OUT/agents64_$mode.log 2>&1
        echo "agents64 $mode exit $?" >> $OUT/results.txt; cp $SCRATCH/b_agents64_$mode/metrics.jsonl $OUT/agents64_$mode.jsonl
        python3 -c "import json,sys,statistics as s; rows=[json.loads(l) for l in open(sys.argv[1])][1:]
print(sys.argv[2], 'gen samples/s median', round(s.median(64 / r['timing_s/gen'] for r in rows), 1))" \
          $SCRATCH/b_agents64_$mode/metrics.jsonl $mode >> $OUT/results.txt 2>&1
      done ;;
    agents_multiturn)  # issue 56 (one GPU; docs/agents.md): agentic rollouts through the gateway, no training (each part
      # under its own timeout, results.txt refreshed after each). AM_PARTS picks parts (default all four):
      # multiturn: the synthetic agent (examples/agents/multiturn_tokens.py: 3-5 turns of 64-256 new tokens, a 20-100
      #   token tool result between turns, each turn re-sent whole as token ids) at 64 and 256 agents on the 0.5B shape,
      #   beside the engine's plain batched rollout of as many trajectories at 640 tokens (the agent's mean: 4 x 160;
      #   `ratio`), and beside a plain rollout of each trajectory's own length (its turns' tokens summed, one row each
      #   in the serving pool the turns decode in: `ratio_own_lengths`, the issue's "same number of tokens per
      #   trajectory", which has the agents' longest-trajectory tail); generated (model) tokens/s of each, medians of
      #   the steps after the first (AM_STEPS agent steps, default 5: the second still captures graphs for new shapes)
      # chat: the chat agent example (two turns of 4 tokens, a tool call between) at 64 and 256 agents: trajectories/s
      #   (agents on the process's agent loop reach the gateway in process), in 12 agent processes (rollout.agent.processes,
      #   rows -p12: the best of 8/12/16 on a 16-core host), and at 64 over the gateway's socket; AM_CHAT picks rows
      #   (default "64 64-p12 256 256-p12 64-http"; a row's flags below), AM_PYSPY samples them too. Seven chat rows
      #   and the multiturn part did not fit one call (2026-11-29): AM_PARTS=chat, then AM_PARTS=multiturn, a call each
      # calc: the calculator agent on the gsm8k sample prompts at 64 and 256 agents (tiny model: mostly one turn)
      # prefix: a turn's admission with prefix reuse against a full prefill of the same ~2k-token context, 1/8/64 rows,
      #   then one more reuse admission of each under torch.profiler (device busy time against wall; the top ops in the log)
      # AM_AGENTS="64 256": the multiturn part's agent counts; AM_FIXED_WAIT=1: their admission wait 30 ms whatever
      #   admissions cost (as before 68c2366; probe_agents --fixed-admit-wait). AM_PYSPY=<seconds>: py-spy samples each multiturn agents'
      #   process (every thread, idle ones too: where the engine thread waits) for that long from the end of its second
      #   step (graphs for new shapes captured); per-thread summary in agents_multiturn_<n>_pyspy_top.txt
      AM_PY="timeout ${AM_TIMEOUT:-300} python3"
      [ -n "${AM_PYSPY:-}" ] && python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy \
        $ROOT/.devicepkgs/extra/py_spy-*.whl > /dev/null 2>&1
      am_spy() {  # $1 the probe's pid, $2 its log, $3 the output: sampled from the second step's end
        for _ in $(seq 600); do grep -q '"step": 1,' $2 2>/dev/null && break; kill -0 $1 2>/dev/null || return; sleep 0.5; done
        timeout $(( AM_PYSPY + 30 )) /tmp/pyspy/bin/py-spy record --pid $1 --subprocesses --threads --idle -r 200 -d $AM_PYSPY -f raw -o $3 \
          > $3.log 2>&1
        python3 $ROOT/tests/gpu/pyspy_top.py $3 25 > ${3%.txt}_top.txt 2>&1
      }
      am_summary() {  # $1 log, $2 label: medians over the steps after the first (agent steps, and plain steps if any)
        python3 -c "import json,sys,statistics as s
rows=[json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
a=[r for r in rows if 'step' in r][1:]; p=[r for r in rows if 'plain_step' in r][1:]; q=[r for r in rows if 'plain_pool_step' in r][1:]
m=lambda rs,k: round(s.median(r.get(k,0) for r in rs),1) if rs else None
out={'agent_traj_per_s':m(a,'trajectories_per_s'),'agent_tok_per_s':m(a,'model_tokens_per_s'),'failed':sum(r['failed'] for r in a),
 'turns':m(a,'turns_mean'),'tokens_per_traj':m(a,'model_tokens_mean'),'engine_busy':m(a,'engine_busy_share'),
 'prefix_hits':m(a,'prefix_hits'),'prefix_new_tokens':m(a,'prefix_new_tokens'),'prefix_reused_tokens':m(a,'prefix_reused_tokens'),
 'admits':m(a,'admits'),'admit_ms_each':m(a,'admit_ms_each'),'cpu_s_engine':m(a,'cpu_s_engine'),'cpu_s_agents':m(a,'cpu_s_agents'),
 'cpu_s_http':m(a,'cpu_s_http'),'cpu_s_agent_procs':m(a,'cpu_s_agent_procs')}
if p: out.update(plain_tok_per_s=m(p,'model_tokens_per_s'),ratio=round(m(a,'model_tokens_per_s')/m(p,'model_tokens_per_s'),3) if a else None)
if q: out.update(plain_own_lengths_tok_per_s=m(q,'model_tokens_per_s'),ratio_own_lengths=round(m(a,'model_tokens_per_s')/m(q,'model_tokens_per_s'),3) if a else None)
print(sys.argv[2], out)" "$1" "$2" >> $OUT/results.txt 2>&1
      }
      MT="$ROOT/examples/bench_qwen0p5b.yaml rollout.agent.function=$ROOT/examples/agents/multiturn_tokens.py:solve
        rollout.max_new_tokens=256 rollout.max_prompt_tokens=2048 rollout.agent.max_turns=5 rollout.agent.timeout_s=240"
      for part in ${AM_PARTS:-multiturn chat calc prefix}; do
        case $part in
          multiturn) for n in ${AM_AGENTS:-64 256}; do
              # the plain rollout alone in its process (--steps 0: no agent step, the gateway's pool never made), then the agents
              CUDA_VISIBLE_DEVICES=$ONE $AM_PY $ROOT/tests/gpu/probe_agents.py $MT --agents $n --steps 0 --plain-tokens 640 --plain-like-multiturn \
                > $OUT/agents_plain_$n.log 2>&1; echo "agents_multiturn plain $n exit $?" >> $OUT/results.txt
              CUDA_VISIBLE_DEVICES=$ONE $AM_PY $ROOT/tests/gpu/probe_agents.py $MT --agents $n --steps ${AM_STEPS:-5} \
                $([ -n "${AM_FIXED_WAIT:-}" ] && echo --fixed-admit-wait) > $OUT/agents_multiturn_$n.log 2>&1 &
              probe=$!; [ -n "${AM_PYSPY:-}" ] && am_spy $probe $OUT/agents_multiturn_$n.log $OUT/agents_multiturn_${n}_pyspy.txt
              wait $probe; echo "agents_multiturn multiturn $n exit $?" >> $OUT/results.txt
              cat $OUT/agents_plain_$n.log $OUT/agents_multiturn_$n.log > $OUT/agents_both_$n.log
              am_summary $OUT/agents_both_$n.log "multiturn $n agents"; cp $OUT/results.txt $FINAL/
            done ;;
          chat) for n in ${AM_CHAT:-64 64-p12 256 256-p12 64-http}; do
              # a row: the agents, then -pN (N agent processes), -http (over the gateway's socket), -bf16 (model.dtype),
              # -wMS (the scheduler's admission wait in ms, default the gateway's 30), -f (that wait whatever admissions cost)
              flags=(); procs=0; dtype=()
              for f in $(echo ${n#*-} | tr - ' '); do case $f in
                p[0-9]*) procs=${f#p} ;; http) flags+=(--http) ;; bf16) dtype=(model.dtype=bfloat16) ;;
                w[0-9]*) flags+=(--admit-wait-s $(python3 -c "print(${f#w}/1000)")) ;; f) flags+=(--fixed-admit-wait) ;;
                esac; done
              CUDA_VISIBLE_DEVICES=$ONE $AM_PY $ROOT/tests/gpu/probe_agents.py $ROOT/examples/agent_chat_tool.yaml hardware=gpu1 \
                rollout.agent.function=$ROOT/examples/agents/chat_tool.py:solve rollout.agent.processes=$procs "${dtype[@]}" \
                --agents ${n%%-*} --steps ${AM_STEPS:-5} "${flags[@]}" > $OUT/agents_chat_$n.log 2>&1 &
              probe=$!; [ -n "${AM_PYSPY:-}" ] && am_spy $probe $OUT/agents_chat_$n.log $OUT/agents_chat_${n}_pyspy.txt
              wait $probe
              echo "agents_multiturn chat $n exit $?" >> $OUT/results.txt; am_summary $OUT/agents_chat_$n.log "chat $n agents"
              cp $OUT/results.txt $FINAL/
            done ;;
          calc) for n in 64 256; do
              CUDA_VISIBLE_DEVICES=$ONE $AM_PY $ROOT/tests/gpu/probe_agents.py $ROOT/examples/gsm8k_calc_agent.yaml hardware=gpu1 \
                rollout.task.data_path=$ROOT/examples/data/gsm8k_sample.jsonl \
                rollout.agent.function=$ROOT/examples/agents/gsm8k_calc.py:solve --agents $n --steps 4 > $OUT/agents_calc_$n.log 2>&1
              echo "agents_multiturn calc $n exit $?" >> $OUT/results.txt; am_summary $OUT/agents_calc_$n.log "calc $n agents"
              cp $OUT/results.txt $FINAL/
            done ;;
          prefix)
            CUDA_VISIBLE_DEVICES=$ONE $AM_PY $ROOT/tests/gpu/probe_prefix.py $ROOT/examples/bench_qwen0p5b.yaml --context 2048 \
              --rows 1,8,64 --profile > $OUT/agents_prefix.log 2>&1; echo "agents_multiturn prefix exit $?" >> $OUT/results.txt
            grep '^{' $OUT/agents_prefix.log >> $OUT/results.txt; cp $OUT/results.txt $FINAL/ ;;
        esac
      done ;;
    scale7b)  # issue 22 (needs 8 GPUs): the 7B shape, bf16, 64 prompts x 8 on the long-tailed lengths, fsdp and deepspeed
      # colocated on 8 GPUs (a trainer rank and an engine per GPU), one bench call
      timeout 590 $RL bench $ROOT/examples/bench_longtail.yaml model=qwen2_7b_shape hardware=gpu8_colocated \
        rollout.prompts_per_step=64 algorithm.steps=3 --backends fsdp,deepspeed --out $SCRATCH/b_scale7b \
        > $OUT/scale7b.log 2>&1; echo "exit $?" >> $OUT/results.txt
      keep scale7b $SCRATCH/b_scale7b; tail -8 $OUT/scale7b.log >> $OUT/results.txt ;;
    weak15b)  # issue 22 (needs 8 GPUs): weak scaling of fsdp, the 1.5B shape, 8 prompts x 8 per GPU on 1, 2, 4, 8 GPUs
      for n in 1 2 4 8; do
        hw=$([ $n = 1 ] && echo "hardware=gpu1" || echo "hardware=gpu${n}_colocated")
        timeout 280 $RL bench $ROOT/examples/bench_longtail.yaml model=qwen2_1p5b_shape $hw \
          rollout.prompts_per_step=$((8 * n)) algorithm.steps=3 --backends fsdp --out $SCRATCH/b_weak$n \
          > $OUT/weak15b_$n.log 2>&1; echo "weak $n exit $?" >> $OUT/results.txt
        keep weak15b_$n $SCRATCH/b_weak$n; tail -3 $OUT/weak15b_$n.log >> $OUT/results.txt
      done ;;
    sync7b)  # issue 22: the 7B shape's nccl push to one rollout server beside a raw broadcast of the same bytes (2 GPUs;
      # a push to 8 engines needs a bridge with several receivers, not built yet)
      timeout 400 python3 -m rlspec.perf.bench_sync --method nccl --model qwen2_7b_shape --repeats 5 \
        --json $OUT/bench_sync7b.json >> $OUT/results.txt 2>&1 ;;
    engines2)  # issue 19 (standalone, several rollout servers): generation samples/s on the long-tailed 64 x 8 workload with
      # 1 and 2 servers, and the push time per server count. 2 GPUs: the servers are joined (rollout.server_urls), one per
      # GPU, the trainer beside server 0 on GPU 0 (idle while they sample), weights by checkpoint (two NCCL ranks cannot
      # share a GPU); 1 server = the server on GPU 1 alone. 3+ GPUs add the started servers on GPUs of their own
      # (hardware=gpu2_separate: trainer on GPU 0, servers on GPUs 1..n) with nccl, 1 and 2 servers: samples/s again
      # and each push's seconds per server (timing_s/sync, timing_s/sync_replica_<i>).
      # E2_STEPS=<n> steps per run (default 4; the first is not counted)
      E2="$ROOT/examples/bench_longtail.yaml rollout.prompts_per_step=64 algorithm.steps=${E2_STEPS:-4}"
      export RLSPEC_SERVE_TOKEN=engines2-measure
      rate() {  # samples/s of generation over the steps after the first (its CUDA graphs are captured then), push seconds
        python3 -c "import json,sys,statistics as s; rows=[json.loads(l) for l in open(sys.argv[1])][1:]
g=[512/r['timing_s/gen'] for r in rows]; print(sys.argv[2], 'gen samples/s median', round(s.median(g),1), 'all', [round(x,1) for x in g],
 'sync_s median', round(s.median([r['timing_s/sync'] for r in rows]),4),
 {k: round(s.median([r[k] for r in rows]),4) for k in rows[0] if k.startswith(('timing_s/sync_replica','timing_s/gen_replica'))})" "$1" "$2" >> $OUT/results.txt 2>&1
      }
      for i in 0 1; do
        CUDA_VISIBLE_DEVICES=$i $RL serve $E2 hardware=gpu1 --port $((8200 + i)) > $OUT/engines2_server$i.log 2>&1 &
        eval "E2_SERVER$i=\$!"
      done
      for n in 1 2; do
        urls=$([ $n = 1 ] && echo "http://127.0.0.1:8201" || echo "http://127.0.0.1:8200,http://127.0.0.1:8201")
        CUDA_VISIBLE_DEVICES=$ONE timeout 400 $RL run $E2 hardware=gpu2_separate hardware.num_rollout_engines=$n \
          sync.method=checkpoint "rollout.server_urls=[$urls]" rollout.server_start_timeout_s=300 \
          --out $SCRATCH/b_engines2_joined$n --no-progress > $OUT/engines2_joined$n.log 2>&1
        echo "joined $n server(s) exit $?" >> $OUT/results.txt; cp $SCRATCH/b_engines2_joined$n/metrics.jsonl $OUT/engines2_joined$n.jsonl
        rate $SCRATCH/b_engines2_joined$n/metrics.jsonl "joined $n"; cp $OUT/results.txt $FINAL/  # kept if the call is cut short
      done
      kill $E2_SERVER0 $E2_SERVER1; wait $E2_SERVER0 $E2_SERVER1
      if [ $(nvidia-smi -L | wc -l) -ge 3 ]; then
        for n in 1 2; do
          timeout 400 $RL run $E2 hardware=gpu2_separate hardware.num_rollout_engines=$n sync.method=nccl \
            --out $SCRATCH/b_engines2_started$n --no-progress > $OUT/engines2_started$n.log 2>&1
          echo "started $n server(s) exit $?" >> $OUT/results.txt; cp $SCRATCH/b_engines2_started$n/metrics.jsonl $OUT/engines2_started$n.jsonl
          rate $SCRATCH/b_engines2_started$n/metrics.jsonl "started $n (nccl)"
        done
      else
        echo "started servers with nccl: skipped, needs 3 GPUs (trainer + 2 servers)" >> $OUT/results.txt
      fi
      unset RLSPEC_SERVE_TOKEN ;;
    multigpu_a|multigpu_b|multigpu_c)  # issue 44: colocated fsdp (a), deepspeed ZeRO-3 (b), ZeRO-1 (c) at 64 x 8 of the
      # bench spec on 1, 2 and 4 GPUs (a trainer rank and an engine on every GPU, each rank feeding its own engine by
      # cuda_ipc), one bench call per row; rows that need more GPUs than the machine has are skipped
      case $section in
        multigpu_a) be=fsdp; tag=fsdp_z3; x="" ;;
        multigpu_b) be=deepspeed; tag=deepspeed_z3; x="hardware.deepspeed.zero_stage=3" ;;
        multigpu_c) be=deepspeed; tag=deepspeed_z1; x="hardware.deepspeed.zero_stage=1" ;;
      esac
      for n in ${MG_GPUS:-1 2 4}; do
        hw=$([ $n = 1 ] && echo "hardware=gpu1" || echo "hardware=gpu${n}_colocated")
        mg_bench ${tag}_${n}gpu $n $(mg_limit $n) $be $BENCH $hw rollout.prompts_per_step=64 algorithm.steps=4 $x
      done ;;
    scale)  # issue 54: scaling of the 0.5B bench spec at fixed lengths, colocated, each row with every rank's trace of
      # one train phase and one push (rlspec.perf.rank_trace: kernel time by kind, host gaps, exposed collectives).
      # ROWS="<backend>:<gpus>:<prompts per GPU>[:<override>...] ..." (default: fsdp on 1 and 2 GPUs at 64 prompts
      # a GPU); strong scaling is the same total (64:1 then 32:2), weak the same per GPU (64:1 then 64:2). Six steps:
      # the bench's medians are of steps 1-5, the traced one (4, slowed by the profiler) one of five
      for r in ${ROWS:-fsdp:1:64 fsdp:2:64 fsdp:2:32}; do
        IFS=: read -r be n per x <<< "$r"
        hw=$([ $n = 1 ] && echo "hardware=gpu1" || echo "hardware=gpu${n}_colocated")
        row=scale_${be}_${n}gpu_${per}${x:+_$(echo $x | tr -c 'a-z0-9\n' '_' | cut -c1-40)}
        RLSPEC_RANK_TRACE=$OUT/trace_$row RLSPEC_RANK_TRACE_CALL=4 mg_bench $row $n $(mg_limit $n) $be $BENCH $hw \
          rollout.prompts_per_step=$((per * n)) algorithm.steps=6 $(echo $x | tr ':' ' ')
        python3 -m rlspec.perf.rank_trace $OUT/trace_$row >> $OUT/results.txt 2>&1
      done ;;
    multigpu_d)  # issue 44: split on 4 GPUs (2 ranks on GPUs 0-1, 2 engines on GPUs 2-3, one nccl broadcast to both
      # engines), fsdp and deepspeed ZeRO-3, 64 x 8 of the bench spec; beside them the colocated rows of a-c
      for be in fsdp deepspeed; do
        mg_bench ${be}_split_4gpu 4 240 $be $BENCH hardware=gpu4_split rollout.prompts_per_step=64 algorithm.steps=4
      done ;;
    multigpu_e)  # issue 44: weak scaling, the 1.5B shape on the long-tailed lengths, 8 prompts x 8 per GPU, fsdp colocated
      # on 1, 2 and 4 GPUs. DISPATCH="auto" (default: the plan's; here split, 64 samples an engine fit its slots) or
      # e.g. DISPATCH="split queue": one row per rollout.dispatch on several GPUs (rows weak_<n>gpu_<dispatch>); the
      # per-engine prompts of each step are in the rows' rollout/prompts_engine_<i>
      for n in ${MG_GPUS:-1 2 4}; do
        hw=$([ $n = 1 ] && echo "hardware=gpu1" || echo "hardware=gpu${n}_colocated")
        for d in $([ $n = 1 ] && echo auto || echo ${DISPATCH:-auto}); do
          mg_bench weak_${n}gpu$([ $d = auto ] || echo _$d) $n $(mg_limit $n) fsdp $ROOT/examples/bench_longtail.yaml \
            model=qwen2_1p5b_shape $hw rollout.prompts_per_step=$((8 * n)) algorithm.steps=4 rollout.dispatch=$d
        done
      done ;;
    multigpu_f)  # issue 44: the 7B shape's push as a run makes it (fsdp ranks and Ray engines, rlspec.perf.bench_sync
      # --backend fsdp), split: one rank broadcasting to 1 and 3 engines beside a raw broadcast of the same bytes
      for e in 1 3; do
        mg_push 7b_nccl_${e}engines $((e + 1)) --method nccl --engines $e
      done ;;
    multigpu_g)  # issue 44: the 7B shape's push colocated: 1, 2 and 4 ranks each feeding the engine on its GPU by
      # cuda_ipc, beside a device copy of the same bytes
      for n in ${MG_GPUS:-1 2 4}; do
        mg_push 7b_ipc_${n}gpu $n --method cuda_ipc --ranks $n
      done ;;
    models)  # issue 47: per model type (MODELS=, presets), the CUDA-graph engine's completion tokens/s beside transformers'
      # generate on the same rows (64 prompts x 8 x 256 new tokens, bf16, SDPA), the engine's log-probs against the
      # trainer's (token_mult_prob_error <= 1.01) and its greedy tokens against generate's (bf16 near ties only: the
      # logit gap at a row's first difference <= 0.125): a JSON line per preset, "pass" and "speedup" in it (the
      # engine at its default 256 slots); SLOTS=512 adds "speedup_512" (the 512 rows as one pool: one more compile,
      # measured last, so with it run one or two presets a call). Each preset in a process of its own, LIMIT= seconds
      # each (default 170: three fit in one call; a preset cut short keeps the parts it measured, in that order)
      for m in ${MODELS:-qwen3_0p6b_shape qwen3_1p7b_shape gemma3_1b_shape}; do
        CUDA_VISIBLE_DEVICES=$ONE timeout ${LIMIT:-170} python3 -m rlspec.perf.bench_models --presets $m --slots "${SLOTS:-}" \
          > $OUT/models_$m.json 2> $OUT/models_$m.log
        echo "models $m exit $?" >> $OUT/results.txt; tail -1 $OUT/models_$m.json >> $OUT/results.txt
        tail -3 $OUT/models_$m.log | grep -iE "error|Traceback" >> $OUT/results.txt; cp $OUT/results.txt $FINAL/
      done ;;
    eval)  # issue 55: the eval section on the 0.5B bench spec, one GPU, P prompts x 8 a step (default 64): an eval of
      # EVAL_PROMPTS held-out prompts (default 512) x K samples (default 4, sampled at the rollout's temperature)
      # before training and every EVERY steps (default 10) of STEPS (default 20). Prints the rollout's samples/s (the
      # training rows' P x 8 / timing_s/gen, the steps after the first), the eval's (EVAL_PROMPTS x K /
      # timing_s/eval, the evals after the first) and their ratio, and the share of the run's time that the evals
      # during training take (sum timing_s/eval / (sum timing_s/step + sum timing_s/eval) over the steps; the eval
      # before training, which also captures the sampler's graphs, left out). The eval data: EVAL_PROMPTS copy_char
      # prompts in a file (eval.data_path, columns prompt and letter), scored by copy_char's reward as training is.
      # At about the rollout's samples/s, an eval of EVAL_PROMPTS x K samples every EVERY steps of P x 8 costs
      # EVAL_PROMPTS x K / (EVERY x P x 8 / gen share + EVAL_PROMPTS x K) of the time: 512 x 4 every 10 steps of 64 x 8
      # (generation about half a step) about 17%; EVAL_PROMPTS=128 about 5%. Then the steady state: the median eval
      # after the first against EVERY median steps.
      P=${P:-64}; EP=${EVAL_PROMPTS:-512}; K=${K:-4}
      python3 -c "import json, random; r = random.Random(0)
open('$SCRATCH/eval_letters.jsonl', 'w').writelines(json.dumps({'prompt': c + '=', 'letter': c}) + '\n' for c in (r.choice('abcd') for _ in range($EP)))"
      CUDA_VISIBLE_DEVICES=$ONE timeout 560 $RL run $BENCH rollout.prompts_per_step=$P algorithm.steps=${STEPS:-20} \
        eval.data_path=$SCRATCH/eval_letters.jsonl eval.samples_per_prompt=$K eval.every_n_steps=${EVERY:-10} eval.before_train=true \
        ${EXTRA:-} --out $SCRATCH/b_eval --no-progress > $OUT/eval.log 2>&1; echo "eval exit $?" >> $OUT/results.txt
      cp $SCRATCH/b_eval/metrics.jsonl $OUT/eval_metrics.jsonl 2>/dev/null
      python3 -c "import json; rows = [json.loads(l) for l in open('$OUT/eval_metrics.jsonl')]
train = [r for r in rows if r['step'] >= 1 and 'timing_s/gen' in r]; evals = [r for r in rows if 'timing_s/eval' in r]
gen = $P * 8 * len(train) / sum(r['timing_s/gen'] for r in train); ev = $EP * $K * (len(evals) - 1) / sum(r['timing_s/eval'] for r in evals[1:])
step = sum(r['timing_s/step'] for r in rows if 'timing_s/step' in r); spent = sum(r['timing_s/eval'] for r in evals if r['step'] >= 0)
print(f'rollout {gen:.0f} samples/s, eval {ev:.0f} samples/s, ratio {ev / gen:.2f}; evals during training {spent:.1f} s of {step + spent:.1f} s = {spent / (step + spent):.1%}')
import statistics as st; one = st.median(r['timing_s/eval'] for r in evals[1:]); med = st.median(r['timing_s/step'] for r in train)
print(f'steady state: an eval {one:.2f} s every ${EVERY:-10} steps of {med:.3f} s (median) = {one / (one + ${EVERY:-10} * med):.1%} of the wall time')
print('eval/mean@$K by step:', [(r['step'], round(r['eval/mean@$K'], 4)) for r in evals])" >> $OUT/results.txt 2>&1
      tail -6 $OUT/eval.log >> $OUT/results.txt ;;
    offload)  # issue 47: rollout.free_during_train, deepspeed colocated on one GPU (its engine a Ray actor of its own
      # on the trainer's GPU, weights by cuda_ipc), P prompts x 8 x 256 (default 16), SHAPE= the model preset (default
      # qwen2_0p5b_shape; qwen3_1p7b_shape for the 1.7B figures), RUNS= the settings compared (default all three, a
      # deepspeed run each: at the 1.7B shape RUNS="none kv_cache" in one call, RUNS=kv_cache_and_weights in the next;
      # on an 80 GB card the 1.7B trainer needs EXTRA="algorithm.micro_batch_tokens=16384 model.gradient_checkpointing=true"),
      # the train layers not compiled (model.compile_layers=false: the runs start sooner; EXTRA= to change it). The
      # bench table's mem/gpu_used_gb is the device's memory in use at the
      # train phase's end (the trainer's cached blocks and what the engine holds); the engine's K/V cache at this
      # shape is printed first (slots x cache length x layers x 2 x kv heads x head dim x 2 bytes)
      SHAPE=${SHAPE:-qwen2_0p5b_shape}; P=${P:-16}
      python3 -c "from rlspec.models.presets import PRESETS as P; c = P['$SHAPE']; d = c.get('head_dim') or c['hidden_size'] // c['num_attention_heads']
slots = min($P * 8, 256); slots = 1 << (slots - 1).bit_length(); length = -(-(128 + 256) // 128) * 128
print('kv cache GB (prompts up to 128 tokens):', round(slots * length * c['num_hidden_layers'] * 2 * c['num_key_value_heads'] * d * 2 / 2**30, 3), 'slots', slots, 'cache length', length)" >> $OUT/results.txt
      runs=""; for r in ${RUNS:-none kv_cache kv_cache_and_weights}; do runs="$runs,deepspeed@rollout.free_during_train=$r"; done
      CUDA_VISIBLE_DEVICES=$ONE timeout 560 $RL bench $BENCH model=$SHAPE hardware=gpu1 sync.method=cuda_ipc \
        rollout.prompts_per_step=$P algorithm.steps=4 model.compile_layers=false ${EXTRA:-} --backends ${runs#,} --out $SCRATCH/b_offload \
        > $OUT/offload_$SHAPE.log 2>&1; echo "offload $SHAPE exit $?" >> $OUT/results.txt
      keep offload_$SHAPE $SCRATCH/b_offload; tail -22 $OUT/offload_$SHAPE.log >> $OUT/results.txt ;;
    faults)  # issue 57: each fault (a killed rank, a killed engine, a stopped rank, a rank out of memory, SIGTERM then
      # --resume on half the GPUs) injected into a colocated run on every GPU here (at most 4) of the bench spec;
      # a JSON row each (tests/gpu/faults.py's header says what is in it). FAULT_BACKENDS= fsdp (default) or deepspeed:
      # one backend a call; FAULTS= a subset; FAULTS_S= the part's time limit (default 560 s)
      # The runs (checkpoints among them) stay in scratch; each row goes to $FINAL as it ends (kept if the call is
      # cut short), the runs' logs and metrics to $OUT afterwards
      rm -rf $SCRATCH/faults; mkdir -p $OUT/faults
      timeout ${FAULTS_S:-560} python3 $ROOT/tests/gpu/faults.py faults --spec $BENCH --out $SCRATCH/faults \
        --backends ${FAULT_BACKENDS:-fsdp} --faults ${FAULTS:-kill_rank,kill_engine,stop_rank,oom,sigterm} \
        2> $OUT/faults.log | tee -a $FINAL/faults_rows.jsonl >> $OUT/results.txt
      echo "faults exit ${PIPESTATUS[0]}" >> $OUT/results.txt
      cp $SCRATCH/faults/*.log $SCRATCH/faults/faults.jsonl $OUT/faults/ 2>/dev/null
      for m in $SCRATCH/faults/*/metrics.jsonl; do [ -f "$m" ] && cp "$m" $OUT/faults/$(basename $(dirname $m)).jsonl; done ;;
    soak)  # issue 57: SOAK_S (default 480) seconds of the bench spec colocated on every GPU here (at most 4), a push
      # every step, stopped by SIGTERM: GPU memory at step 10 and at the end, step times against their median, the
      # run's host RSS trend (tests/gpu/faults.py soak); SOAK_BACKEND= fsdp (default) or deepspeed
      rm -rf $SCRATCH/soak; mkdir -p $OUT/soak
      timeout 590 python3 $ROOT/tests/gpu/faults.py soak --spec $BENCH --out $SCRATCH/soak --backend ${SOAK_BACKEND:-fsdp} \
        --seconds ${SOAK_S:-480} 2> $OUT/soak.log | tee -a $FINAL/soak_result.json >> $OUT/results.txt
      echo "soak exit ${PIPESTATUS[0]}" >> $OUT/results.txt
      cp $SCRATCH/soak/soak.log $SCRATCH/soak/soak.json $SCRATCH/soak/soak/metrics.jsonl $OUT/soak/ 2>/dev/null ;;
    *) echo "unknown section $section" >> $OUT/results.txt ;;
  esac
  echo "-- $section took $(( $(date +%s) - start )) s" >> $OUT/results.txt
  cp $OUT/results.txt $FINAL/; tar -czf $FINAL/all.tgz -C $OUT .
done
