#!/usr/bin/env bash
# One run on a GPU host: install the copied wheels (.gpu/whl: sglang's small
# deps for Python 3.12; .gpu/dist: the patched cp312 sglang wheel), put the
# test-only sgl_kernel stand-in first, run every mode of gpu_tp_run.py and
# leave one JSON per mode in $OUT. Prepare .gpu with gpu_bundle.sh.
# Knobs: ITERS (loads per mode), GATE_ITERS, NOGATE=1 (also the ungated run),
# PROFILE=1 (cProfile of one extra load per mode, top functions in the JSON),
# TRACE=1 (torch.profiler timeline of one extra load per mode, summarised in
# the JSON by trace_summary.py), REPEAT=1 (replicated and sharded
# once more at the end: drift between launches), BATCH=1 (replicated,
# sharded and copy_only also with the stand-in's sglang-kernel-like
# cudaMemcpyBatchAsync instead of its strided 2-D copies,
# SGL_STANDIN_COPY=batch), NCCL_SWEEP=1 (sharded under a few NCCL settings).
# Files written: smoke, replicated, sharded, copy_only and gate (5); REPEAT
# adds 2, BATCH 3, NCCL_SWEEP 3, NOGATE 1 (NOGATE goes with REPEAT).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
# The runs' JSON records the bundle's revision (bench_meta.py says why).
export SGL_BENCH_BUNDLED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target .gpu/site .gpu/whl/*.whl .gpu/dist/*.whl || exit 1
export PYTHONPATH=$PWD/tests/standins/gpu:$PWD/.gpu/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
nvidia-smi topo -m | head -4
python3 -c "import torch, sglang; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'sglang', sglang.__version__)" || exit 1
B="-m benchmark.hicache_rank_shard.gpu_tp_run"
python3 $B --mode sharded --tokens 4096 --layers 5 --iters 2 --out $OUT/smoke.json --timeout 200 || exit 1
for mode in replicated sharded copy_only; do
  python3 $B --mode $mode --iters ${ITERS:-10} ${PROFILE:+--profile} ${TRACE:+--trace} --out $OUT/$mode.json --timeout 300
done
if [ -n "${REPEAT:-}" ]; then
  for mode in replicated sharded; do
    python3 $B --mode $mode --iters ${ITERS:-10} --out $OUT/${mode}_rep.json --timeout 300
  done
fi
if [ -n "${BATCH:-}" ]; then
  for mode in replicated sharded copy_only; do
    SGL_STANDIN_COPY=batch python3 $B --mode $mode --iters ${ITERS:-10} --out $OUT/${mode}_batch.json --timeout 300
  done
fi
if [ -n "${NCCL_SWEEP:-}" ]; then
  for setting in NCCL_P2P_READ_ENABLE=0 NCCL_PROTO=Simple NCCL_PROTO=LL128; do
    env $setting python3 $B --mode sharded --iters ${ITERS:-10} --out $OUT/sharded_${setting//=/_}.json --timeout 300
  done
fi
python3 $B --mode gate --gate-iters ${GATE_ITERS:-2000} --out $OUT/gate.json --timeout 240
[ -n "${NOGATE:-}" ] && python3 $B --mode gate --no-gate --gate-iters ${GATE_ITERS:-2000} --out $OUT/nogate.json --timeout 120
