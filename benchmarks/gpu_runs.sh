#!/usr/bin/env bash
# The GPU calls of issues 4-7 on a machine of 4 GPUs (nvidia-h200-x4), independent jobs side by side,
# each on its own GPUs and its own cores (taskset), so one lease does the work of several:
#   bash benchmarks/gpu_runs.sh offload-plan   (carry .whl)
#     GPU 0, 16 cores: issue 5 without accumulation (gpu_offload.sh main: limits, bigfit, peers);
#     GPU 1, 16 other cores: issue 5 with accumulation 4 (gpu_offload.sh accum);
#     GPU 2: issue 4's missing plan-accuracy cases; GPU 3: issue 6's T5 over cuda + cpu.
#   bash benchmarks/gpu_runs.sh offload-scaling  issue 5 without accumulation alone on the host's CPU side
#     (GPU 0), beside issue 7's scaling.py on 1 GPU (GPU 1) and on 2 GPUs (GPUs 2, 3)
#   bash benchmarks/gpu_runs.sh scaling4       issue 7: scaling.py on 4 GPUs, then t5-3b over 2 GPUs
#   bash benchmarks/gpu_runs.sh pipeline       issue 7: benchmarks/pipeline.py on 2 and 4 GPUs
#   bash benchmarks/gpu_runs.sh dm-host        issue 6's chunks after the overlap rewrite, GPU 0 + 16 cores:
#     tests/test_device_map.py on real streams, then T5-large over cuda:0 + cpu
#   bash benchmarks/gpu_runs.sh dm-gpus        the same over two GPUs (x2 or more): tests with the
#     cuda:0 + cuda:1 placement, T5-large at batch 8 and at batch 32 (compute-bound), traces of batch 32
#   bash benchmarks/gpu_runs.sh kernel         issue 5 with the host Adam kernel, single-GPU machine (carry .whl)
#   bash benchmarks/gpu_runs.sh kernel2        issue 5: the delayed update's uploads from backward's hooks (carry .whl)
#   bash benchmarks/gpu_runs.sh kernel3        issue 5 again after the norm's wait was narrowed (carry .whl)
#   bash benchmarks/gpu_runs.sh kernel4        issue 5: the kernel with dynamic chunks (carry .whl)
#   bash benchmarks/gpu_runs.sh next-x2 / next-h200   prepared for a later session (not yet run)
#   bash benchmarks/gpu_runs.sh scale8b        issue 7's 8B on 2 GPUs, bigfit and peers (x2; carry .whl)
#   bash benchmarks/gpu_runs.sh s6-offload     sixth session, single GPU: exactly-sized pinned buffers,
#     the engine at 3.6B with them beside DeepSpeed (carry .whl)
#   bash benchmarks/gpu_runs.sh s6-z3          sixth session, single GPU: DeepSpeed ZeRO-3 offload's largest model
#   bash benchmarks/gpu_runs.sh s6-dm          sixth session, single GPU: device-map chunks with the host
#     segments beside the GPU's, T5-large over cuda:0 + cpu
#   bash benchmarks/gpu_runs.sh s6-compile     sixth session, single GPU: the same with compiled GPU blocks
#   bash benchmarks/gpu_runs.sh s6-train       sixth session, single GPU: bigfit train --compile itself
#   bash benchmarks/gpu_runs.sh next-x2-dm     prepared for a 2-GPU call: compiled device-map chunks over two GPUs
#   (s6-*, next-x2-dm: files straight into $OUT, so a call cut short keeps what it measured)
#   (peers12 and final: the third session's 2-GPU calls, kept as they ran; RESULTS.md)
# 16 cores is the core count of the single-GPU machine that issue 5's figures come from. Jobs that
# share the host's memory bandwidth can slow each other's CPU optimizer: the offload jobs go on
# different NUMA nodes where there are two. Everything lands in $OUT/<part>.tgz (one file back).
set -u
part=$1; out=${OUT:-/tmp/out}; r=/tmp/r; mkdir -p "$r" "$out"
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site \
  .whl/deepspeed-*.tar.gz 2>&1 | tail -1
export BIGFIT_SKIP_INSTALL=1
# DeepSpeed's FusedAdam build reads torch 2.11's arch list ("9.0a") and fails: name the arch
export TORCH_CUDA_ARCH_LIST=9.0
nproc; nvidia-smi -L; lscpu | grep -i "numa node"
# cores by NUMA node: the offload jobs get the first 16 of the first and of the last node (the same
# node's next 16 where there is one node); the light jobs get 8 each from the first node's end
node_cpus() { lscpu -p=CPU,NODE | grep -v '^#' | awk -F, -v n="$1" '$2==n{print $1}'; }
last=$(lscpu -p=NODE | grep -v '^#' | sort -n | tail -1)
first_node=$(node_cpus 0); last_node=$(node_cpus "$last")
pick() { echo "$1" | sed -n "$2,$3p" | paste -sd,; }  # pick LIST FROM TO (1-based)
n0=$(echo "$first_node" | wc -l)
c_main=$(pick "$first_node" 1 16)
c_accum=$([ "$last" != 0 ] && pick "$last_node" 1 16 || pick "$first_node" 17 32)
c_light1=$(pick "$first_node" $((n0 - 7)) $n0); c_light2=$(pick "$first_node" $((n0 - 15)) $((n0 - 8)))
job() {  # job NAME GPUS CORES TIMEOUT CMD...: runs CMD in the background, its log in $r/NAME.log
  local name=$1 gpus=$2 cpus=$3 t=$4; shift 4
  echo "job $name: GPUs $gpus, cores $cpus"
  (CUDA_VISIBLE_DEVICES=$gpus OMP_NUM_THREADS=$(echo "$cpus" | tr , '\n' | wc -l) OUT=$r/$name \
   timeout "$t" taskset -c "$cpus" "$@" > "$r/$name.log" 2>&1; echo "job $name exit $?" >> "$r/$name.log") &
}
case $part in
offload-plan)
  mkdir -p $r/main $r/accum $r/plan $r/dm
  job main 0 "$c_main" 520 bash benchmarks/gpu_offload.sh 3b main
  job accum 1 "$c_accum" 520 bash benchmarks/gpu_offload.sh 3b accum
  job plan 2 "$c_light1" 520 bash -c 'for c in "zero3 llama 2" "zero3 llama 8" "zero3 gpt2 8" \
      "zero2-offload llama 2" "zero2-offload llama 8" "zero2-offload gpt2 2" "zero2-offload gpt2 8"; do
    python3 benchmarks/plan_accuracy.py --one $c 1024 | grep ^RESULT | cut -c8- | tee -a $OUT/plan_accuracy.jsonl; done'
  job dm 3 "$c_light2" 520 python3 benchmarks/device_map.py --out $r/dm/device_map.jsonl
  ;;
offload-scaling)  # issue 5 again on a quiet host (delayed first, with stacks if it hangs); issue 7 on 1 and 2 GPUs
  mkdir -p $r/main $r/s1 $r/s2
  common="--size 3b --mbs 4 --seq 2048 --steps 4 --warmup 2"
  job main 0 "$c_main" 530 bash -c "BIGFIT_STACKS_AFTER=90 python3 benchmarks/strategies.py $common --timeout 170 \
      --strategies zero2-offload+delayed,zero2-offload,zero2-offload+eager --out $r/main/offload.jsonl
    python3 .whl/peers.py all $common --methods torch,fsdp2-offload,ds-z2-offload | tee -a $r/main/peers.txt
    python3 benchmarks/offload_limits.py --out $r/main/limits.json
    python3 benchmarks/plot_trace.py $r/main/offload.jsonl 'bigfit zero2-offload+eager' $r/main/timeline-eager.png"
  job s1 1 "$c_light1" 530 python3 benchmarks/scaling.py --gpus 1 --timeout 150 --size 3b --out $r/s1/scaling.jsonl
  job s2 2,3 "$c_accum" 530 python3 benchmarks/scaling.py --gpus 2 --timeout 150 --size 3b --out $r/s2/scaling.jsonl
  ;;
scaling4)  # issue 7 on 4 GPUs, then t5-3b's shape over 2 GPUs with device maps
  mkdir -p $r/s4 $r/dm2
  job s4 0,1,2,3 "$(pick "$first_node" 1 $((n0 > 48 ? 48 : n0)))" 420 python3 benchmarks/scaling.py --gpus 4 --timeout 100 --size 3b \
    --out $r/s4/scaling.jsonl
  wait
  job dm2 0,1 "$c_main" 150 python3 benchmarks/device_map.py --size 3b --other cuda:1 --out $r/dm2/device_map.jsonl
  ;;
dm-host)  # chunks over cuda:0 + the host (docs/device_map.md): results on real streams, then the figures
  mkdir -p $r/dmt $r/dm
  job dmt 0 "$c_main" 200 python3 -m pytest tests/test_device_map.py -q -x
  wait
  job dm 0 "$c_main" 380 python3 benchmarks/device_map.py --out $r/dm/device_map.jsonl
  ;;
dm-gpus)  # chunks over two GPUs: launch-bound batch 8 and compute-bound batch 32, traced
  mkdir -p $r/dmt $r/dm2
  job dmt 0,1 "$c_main" 200 python3 -m pytest tests/test_device_map.py -q -x
  wait
  job dm2 0,1 "$c_main" 380 bash -c "python3 benchmarks/device_map.py --other cuda:1 --out $r/dm2/device_map.jsonl
    python3 benchmarks/device_map.py --other cuda:1 --batch 32 --trace $r/dm2/trace --out $r/dm2/device_map.jsonl"
  ;;
peers12)  # 2 GPUs: a hang hunt on GPU 0 beside issue 7's peers on 1 GPU, then the peers on 2 GPUs
  mkdir -p $r/main $r/s1 $r/s2
  job main 0 "$c_main" 150 env BIGFIT_STACKS_AFTER=50 python3 benchmarks/strategies.py --size 3b --mbs 4 --seq 2048 \
    --steps 4 --warmup 2 --timeout 135 --strategies zero2-offload+delayed --out $r/main/offload.jsonl
  job s1 1 "$c_accum" 150 python3 benchmarks/scaling.py --gpus 1 --timeout 75 --methods fsdp2,ds-z2,ds-z3 --size 3b \
    --out $r/s1/scaling.jsonl
  wait
  job s2 0,1 "$c_main" 230 python3 benchmarks/scaling.py --gpus 2 --timeout 75 --methods fsdp2,ds-z3,ds-z2 --size 3b \
    --out $r/s2/scaling.jsonl
  ;;
final)  # 2 GPUs: the delayed update after its fix (GPU 0) beside DeepSpeed ZeRO-3 on 1 GPU, then on 2
  mkdir -p $r/main $r/s1 $r/s2
  job main 0 "$c_main" 110 python3 benchmarks/strategies.py --size 3b --mbs 4 --seq 2048 \
    --steps 4 --warmup 2 --timeout 105 --strategies zero2-offload+delayed --out $r/main/offload.jsonl
  job s1 1 "$c_accum" 150 python3 benchmarks/scaling.py --gpus 1 --timeout 145 --methods ds-z3 --size 3b \
    --out $r/s1/scaling.jsonl
  wait
  job s2 0,1 "$c_main" 90 python3 benchmarks/scaling.py --gpus 2 --timeout 85 --methods ds-z3 --size 3b \
    --out $r/s2/scaling.jsonl
  ;;
pipeline)  # issue 7 item 2: schedules' bubbles and pipeline against zero3, on 2 GPUs then on 4
  mkdir -p $r/pipe
  job p2 0,1 "$c_main" 280 python3 benchmarks/pipeline.py --gpus 2 --size 3b --out $r/pipe/pipeline.jsonl
  wait
  job p4 0,1,2,3 "$(pick "$first_node" 1 $((n0 > 48 ? 48 : n0)))" 280 python3 benchmarks/pipeline.py --gpus 4 \
    --size 3b --out $r/pipe/pipeline.jsonl
  ;;
x2a)  # fourth session, 2 GPUs: issue 6 over cuda:0 + host (GPU 0) beside issue 5's accumulation and
  # DeepSpeed ZeRO-2 on 1 GPU (GPU 1); then issue 7 on both GPUs: DeepSpeed ZeRO-2 and t5-3b's device maps
  mkdir -p $r/dmh $r/one $r/two
  job dmh 0 "$c_main" 280 bash -c "python3 -m pytest tests/test_device_map.py -q -x 2>&1 | tail -3
    python3 benchmarks/device_map.py --out $r/dmh/device_map.jsonl"
  common="--size 3b --mbs 4 --seq 2048 --steps 4 --warmup 2"
  job one 1 "$c_accum" 280 bash -c "python3 benchmarks/strategies.py $common --accum 4 --timeout 110 \
      --strategies zero2-offload+delayed --out $r/one/offload-accum.jsonl
    python3 .whl/peers.py all $common --accum 4 --methods torch | tee -a $r/one/peers-accum.txt
    python3 benchmarks/scaling.py --gpus 1 --timeout 120 --methods ds-z2 --size 3b --out $r/one/scaling.jsonl"
  wait
  df -h /tmp | tee $r/disk.txt; dd if=/dev/zero of=/tmp/dd.bin bs=1M count=4096 oflag=direct 2>&1 | tail -1 | tee -a $r/disk.txt
  dd if=/tmp/dd.bin of=/dev/null bs=1M iflag=direct 2>&1 | tail -1 | tee -a $r/disk.txt; rm -f /tmp/dd.bin
  job two 0,1 "$(pick "$first_node" 1 $((n0 > 32 ? 32 : n0)))" 260 bash -c "python3 benchmarks/scaling.py --gpus 2 \
      --timeout 100 --methods ds-z2 --size 3b --out $r/two/scaling.jsonl
    python3 benchmarks/device_map.py --size 3b --other cuda:1 --out $r/two/device_map-t5-3b.jsonl"
  ;;
x2b)  # fourth session, 2 GPUs: issue 7's pipeline schedules (m = 4, 8) against zero3, then T5-large's chunks
  mkdir -p $r/pipe $r/dm2
  job p2 0,1 "$c_main" 330 python3 benchmarks/pipeline.py --gpus 2 --size 3b --ms 4,8 --timeout 100 \
    --out $r/pipe/pipeline.jsonl
  wait
  job dm2 0,1 "$c_main" 200 python3 benchmarks/device_map.py --other cuda:1 --batch 32 --trace $r/dm2/trace \
    --out $r/dm2/device_map.jsonl
  ;;
capacity)  # issue 5's largest model, on the single-GPU machine (its 125 GiB of RAM and its disk), one
  # attempt at a time: DeepSpeed ZeRO-2 offload at 32 layers (8.0B), then 36 or 28; bigfit at 1.5x the
  # largest that DeepSpeed fitted, gradients on the GPU, 95 GB of states in RAM and the rest on disk
  mkdir -p $r/cap; df -h /tmp | tee $r/cap/disk.txt; free -g | tee -a $r/cap/disk.txt
  python3 -c "import torch; from deepspeed.ops.adam import DeepSpeedCPUAdam; DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))])" 2>&1 | tail -1
  python3 benchmarks/strategies.py --size tiny --seq 64 --steps 2 --strategies zero2-offload+devgrads,zero2-offload-nvme+devgrads \
    --timeout 60 --out $r/cap/cuda-smoke.jsonl | cut -c1-300
  lm() { python3 benchmarks/largest_model.py --out $r/cap/largest.jsonl "$@" | tail -1; }
  if lm --methods ds-z2-offload --layers 32 --timeout 140 | grep -q '"ds-z2-offload"'; then
    lm --methods ds-z2-offload --layers 36 --timeout 140; big=51
  else
    lm --methods ds-z2-offload --layers 28 --timeout 140; big=45
  fi
  # states in RAM: what is available less 22 GB (gradient slots, CUDA, Python, page cache); the rest
  # on disk, less 4 GB: if RAM and disk hold fewer than $big layers' 12 bytes per parameter, fewer layers
  read host_gb big < <(python3 -c "import os, shutil
avail = int([l.split()[1] for l in open('/proc/meminfo') if l.startswith('MemAvailable')][0]) * 1024 / 1e9
host = int(avail - 22); disk = shutil.disk_usage('/tmp').free / 1e9 - 4
fit = int(((host + disk) / 12 - 1.051) / 0.2181)
print(host, min($big, fit))")
  echo "states in RAM: $host_gb GB; layers: $big"
  BIGFIT_NVME_HOST_GB=$host_gb lm --methods zero2-offload-nvme+devgrads --layers $big --timeout 260
  df -h /tmp | tee -a $r/cap/disk.txt
  ;;
capacity2)  # the same machine: DeepSpeed ZeRO-2 offload at 24 layers (6.3B; it was killed at 28), bigfit
  # with everything in RAM (gradients on the GPU) at 40 layers (9.8B), and the 3.6B step with gradients on the GPU
  mkdir -p $r/cap
  python3 -c "import torch; from deepspeed.ops.adam import DeepSpeedCPUAdam; DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))])" 2>&1 | tail -1
  python3 benchmarks/largest_model.py --out $r/cap/largest.jsonl --methods ds-z2-offload --layers 24 --timeout 130 | tail -1
  python3 benchmarks/largest_model.py --out $r/cap/largest.jsonl --methods zero2-offload+devgrads --layers 40 --timeout 150 | tail -1
  python3 benchmarks/strategies.py --size 3b --mbs 4 --seq 2048 --steps 4 --warmup 2 --timeout 75 \
    --strategies zero2-offload+devgrads,zero2-offload+delayed+devgrads --out $r/cap/offload-devgrads.jsonl | cut -c1-250
  ;;
kernel)  # fifth session, the single-GPU machine (issue 5's): the engine's host step through bigfit's
  # kernel (bf16 gradients) against torch's fused AdamW, DeepSpeed ZeRO-2 offload and plain PyTorch in the same call
  mkdir -p $r/k
  common="--size 3b --mbs 4 --seq 2048 --steps 4 --warmup 2"
  python3 benchmarks/offload_limits.py --gib 1 --out $r/k/limits.json
  python3 benchmarks/strategies.py $common --timeout 150 --out $r/k/offload.jsonl \
    --strategies zero2-offload+delayed,zero2-offload+delayed+torchadam,zero2-offload+eager | cut -c1-260
  python3 .whl/peers.py all $common --methods torch,ds-z2-offload | tee -a $r/k/peers.txt
  python3 benchmarks/plot_trace.py $r/k/offload.jsonl 'bigfit zero2-offload+delayed' $r/k/timeline-delayed.png
  ;;
kernel2)  # fifth session, single-GPU machine: the delayed update after its uploads moved into the next
  # backward's hooks (and its host-step order), DeepSpeed in the same call; accumulation 4 against
  # plain PyTorch; zero3-offload's host step streamed under backward (eager) or after it, at 1.5B
  mkdir -p $r/k2
  common="--size 3b --mbs 4 --seq 2048 --steps 6 --warmup 2"
  python3 benchmarks/strategies.py $common --timeout 110 --out $r/k2/offload.jsonl \
    --strategies zero2-offload+delayed | cut -c1-260
  python3 .whl/peers.py all $common --methods ds-z2-offload | tee -a $r/k2/peers.txt
  acc="--size 3b --mbs 4 --seq 2048 --steps 3 --warmup 1 --accum 4"
  python3 benchmarks/strategies.py $acc --timeout 100 --out $r/k2/accum.jsonl --strategies zero2-offload+delayed | cut -c1-260
  python3 .whl/peers.py all $acc --methods torch | tee -a $r/k2/peers.txt
  python3 benchmarks/strategies.py --size 1b --mbs 4 --seq 2048 --steps 4 --warmup 2 --timeout 90 \
    --out $r/k2/z3.jsonl --strategies zero3-offload+eager,zero3-offload | cut -c1-260
  python3 benchmarks/plot_trace.py $r/k2/offload.jsonl 'bigfit zero2-offload+delayed' $r/k2/timeline-delayed.png
  ;;
kernel3)  # fifth session, single-GPU machine: after the norm stopped waiting for the last gradient copy,
  # the engine's modes, the machine's limits and DeepSpeed in one call
  mkdir -p $r/k3
  common="--size 3b --mbs 4 --seq 2048 --steps 6 --warmup 2"
  python3 benchmarks/offload_limits.py --gib 1 --out $r/k3/limits.json
  python3 benchmarks/strategies.py $common --timeout 110 --out $r/k3/offload.jsonl \
    --strategies zero2-offload+delayed,zero2-offload | cut -c1-260
  python3 .whl/peers.py all $common --methods ds-z2-offload | tee -a $r/k3/peers.txt
  python3 benchmarks/plot_trace.py $r/k3/offload.jsonl 'bigfit zero2-offload+delayed' $r/k3/timeline-delayed.png
  ;;
kernel4)  # fifth session, single-GPU machine: the kernel's chunks handed out dynamically, DeepSpeed in the same call
  mkdir -p $r/k4
  common="--size 3b --mbs 4 --seq 2048 --steps 6 --warmup 2"
  python3 benchmarks/offload_limits.py --gib 1 --out $r/k4/limits.json
  python3 benchmarks/strategies.py $common --timeout 100 --out $r/k4/offload.jsonl --strategies zero2-offload+delayed | cut -c1-260
  python3 .whl/peers.py all $common --methods ds-z2-offload | tee -a $r/k4/peers.txt
  ;;
next-x2)  # for the next 2-GPU call: issue 7's 8B and 3.6B on 2 GPUs at the peers' settings (no clipping)
  mkdir -p $r/nx
  python3 benchmarks/scaling.py --gpus 2 --size 8b --mbs 2 --steps 4 --warmup 2 --timeout 100 \
    --methods zero2+noclip,zero3+noclip,fsdp2 --out $r/nx/scaling-8b.jsonl
  python3 benchmarks/scaling.py --gpus 1,2 --size 3b --mbs 4 --steps 4 --warmup 2 --timeout 90 \
    --methods zero2+noclip,zero3+noclip,fsdp2 --out $r/nx/scaling-3b.jsonl
  ;;
next-h200)  # for a later single-GPU call: the NVMe tier's steady step, 1.5B with every state in files
  # (18 GB), 4 steps after 2, against the planner. (This part's pinned-memory and DeepSpeed ZeRO-3
  # lines ran in the sixth session as s6-offload and s6-z3.) 18 GB fit the host's page cache, so this
  # measures the page cache unless the files outgrow it: a fair disk figure needs states over ~100 GB.
  mkdir -p $r/n5
  rm -rf /tmp/bigfit-nvme; BIGFIT_NVME_HOST_GB=0 python3 benchmarks/strategies.py --size 1b --mbs 4 --seq 2048 \
    --steps 4 --warmup 2 --timeout 240 --strategies zero2-offload-nvme+devgrads --out $r/n5/nvme.jsonl | cut -c1-300
  ;;
s6-offload)  # issue 5: pinned.py's buffers checked, then the engine at 3.6B with them and with torch's
  # pinned allocator (BIGFIT_PINNED=torch: host RSS and step side by side), DeepSpeed ZeRO-2 offload beside
  timeout 60 python3 benchmarks/pinned_rounding.py 2>&1 | tee "$out/pinned.json"
  common="--size 3b --mbs 4 --seq 2048 --steps 6 --warmup 2"
  python3 benchmarks/strategies.py $common --timeout 100 --out "$out/offload.jsonl" --strategies zero2-offload+delayed | cut -c1-300
  BIGFIT_PINNED=torch python3 benchmarks/strategies.py $common --timeout 100 --out "$out/offload-torchpinned.jsonl" \
    --strategies zero2-offload+delayed | cut -c1-300
  timeout 120 python3 -c "import torch; from deepspeed.ops.adam import DeepSpeedCPUAdam; DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))])" 2>&1 | tail -1
  python3 .whl/peers.py all $common --timeout 110 --methods ds-z2-offload | tee -a "$out/peers.txt"
  ;;
s6-z3)  # issue 5: DeepSpeed ZeRO-3 offload's largest model (bf16 parameters, fp32 gradients and states in
  # host RAM) from 24 layers (6.28B: ZeRO-2 offload was killed there) up, until one does not fit; the
  # host's used/available GiB every 5 s (a process the OOM killer takes prints nothing)
  (while sleep 5; do echo "$(date +%T) $(free -g | awk '/Mem:/{print $3, $7}')"; done) > "$out/free.log" & logger=$!
  timeout 120 python3 -c "import torch; from deepspeed.ops.adam import DeepSpeedCPUAdam; DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))])" 2>&1 | tail -1
  python3 benchmarks/largest_model.py --out "$out/largest.jsonl" --methods ds-z3-offload --layers 24,28,32 --timeout 170 | tail -4
  kill $logger
  ;;
s6-dm)  # issue 6: chunks over cuda:0 + cpu with a tick's host segments beside its GPU segments, against
  # them after (the old order) and against no chunks; the tests on real streams first
  timeout 90 python3 -m pytest tests/test_device_map.py -q -x 2>&1 | tail -3 | tee "$out/dm-tests.txt"
  dm="python3 benchmarks/device_map.py --beams 0 --steps 3 --warmup 1 --sequential --out $out/device_map.jsonl"
  timeout 120 $dm --layouts unsplit,tail --chunks 2,4 --batch 64
  timeout 130 $dm --layouts unsplit,tail --chunks 2,4 --batch 128
  timeout 90 $dm --layouts unsplit,flat --chunks 4 --batch 8
  ;;
s6-compile)  # issue 6: the same with each GPU block's forward compiled (device_map.py --compile gpu: fewer,
  # fused kernels issued from generated code, not the model's Python), an eager baseline first
  dm="python3 benchmarks/device_map.py --beams 0 --steps 3 --warmup 1 --out $out/device_map.jsonl"
  timeout 80 $dm --layouts unsplit,tail --chunks 2 --batch 64
  timeout 300 $dm --layouts unsplit,tail --chunks 2,4 --sequential --batch 64 --compile gpu
  timeout 120 $dm --layouts unsplit,tail --chunks 2,4 --batch 128 --compile gpu
  ;;
s6-train)  # issue 6: `bigfit train --compile` itself (engine/compiling.py, inductor) on T5-large's shape,
  # the embedded task at batch 64, against eager; then the tail device map with 2 chunks, compiled
  python3 -c "from transformers import T5Config as C; C(d_model=1024, d_ff=4096, d_kv=64, num_heads=16, num_layers=24,
num_decoder_layers=24, vocab_size=32128, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1).save_pretrained('/tmp/t5l')"
  echo '{"encoder": {"cuda:0": [0-23]}, "decoder": {"cuda:0": [0-22], "cpu": [23]}}' | python3 -c "import json, sys
s = sys.stdin.read().replace('[0-23]', str(list(range(24)))).replace('[0-22]', str(list(range(23)))); json.dump(json.loads(s), open('/tmp/tail.json', 'w'))"
  t="python3 -m bigfit train --model /tmp/t5l --precision bf16 --batch-size 64 --max-steps 25 --warmup-steps 5 --lr 1e-4
     --eval-every 0 --eval-samples 16 --save-every 0 --no-consolidate"
  summary() { python3 -c "import json, statistics as s; r = [json.loads(l) for l in open('$1/metrics.jsonl')][10:]
print('$1', 'median tok/s over steps 11-25:', round(s.median(x['tokens_per_s'] for x in r)), 'last loss', round(r[-1]['loss'], 3))" | tee -a "$out/train.txt"; }
  timeout 70 $t --strategy single --output-dir /tmp/o-eager > "$out/train-eager.log" 2>&1; summary /tmp/o-eager
  timeout 170 $t --strategy single --compile --output-dir /tmp/o-compile > "$out/train-compile.log" 2>&1; summary /tmp/o-compile
  timeout 100 $t --strategy device_map --device-map /tmp/tail.json --chunks 2 --compile --output-dir /tmp/o-dm \
    > "$out/train-dm.log" 2>&1; summary /tmp/o-dm
  ;;
next-x2-dm)  # for the next 2-GPU call (issue 6's last run, issue 7 item 3): device-map chunks over two GPUs
  # with every block compiled, where each GPU's segment should take longer than issuing it
  timeout 120 python3 -m pytest tests/test_device_map.py tests/test_engine_compiling.py -q -x 2>&1 | tail -3 | tee "$out/dm-tests.txt"
  dm="python3 benchmarks/device_map.py --other cuda:1 --beams 0 --steps 3 --warmup 1 --out $out/device_map.jsonl"
  timeout 200 $dm --layouts unsplit,flat,split --chunks 2,4 --batch 32 --compile all
  timeout 200 $dm --size 3b --layouts unsplit,flat,split --chunks 2,4 --batch 16 --compile all
  ;;
scale8b)  # fifth session, 2 GPUs: issue 7's 8B (peers.py's shape) on 2 GPUs, bigfit and peers; at 1 GPU
  # none of these fits (16 bytes a parameter is 128 GB before activations: the planner's no-fit)
  mkdir -p $r/s8
  python3 benchmarks/scaling.py --gpus 2 --size 8b --mbs 2 --steps 4 --warmup 2 --timeout 100 \
    --methods zero2,zero3,fsdp2,ds-z2,ds-z3 --out $r/s8/scaling.jsonl
  ;;
esac
wait
for f in $r/*.log; do echo "== $f"; tail -25 "$f"; done
# Chrome traces apart: one file back is at most 16 MiB
traces=$(cd $r && find . -type d -name trace)
[ -n "$traces" ] && tar czf "$out/$part-trace.tgz" -C "$r" $traces
tar czf "$out/$part.tgz" --exclude=./*/trace -C "$r" .
