#!/usr/bin/env bash
# What a CUDA client sees under MPS when the daemon and the client were given different CUDA_VISIBLE_DEVICES
# (a machine of >= 2 GPUs; ~50 s):  run(command="bash bench/mps_two_gpus.sh", kind="nvidia-h200-x2", timeout_s=170)
#   case 1: a daemon per GPU started with CUDA_VISIBLE_DEVICES=N, a client with the same N
#   case 2: a daemon per GPU started without CUDA_VISIBLE_DEVICES, a client with N
#   case 3: one daemon, clients on both GPUs
# 2 x H200, 2026-11-29: case 1 fails for GPU 1 (the daemon renumbers its one GPU as 0: "Client requested 1 which
# is not a valid GPU ID in the MPS visible set of devices"; torch then sees no GPU), cases 2 and 3 run. So the
# engine's private daemon starts without CUDA_VISIBLE_DEVICES (rapidserve/engine/mps.py), and the workers keep it.
set -u
out=${OUT:-/tmp/mpsout}; mkdir -p $out
client() { CUDA_VISIBLE_DEVICES=$1 CUDA_MPS_PIPE_DIRECTORY=$2/pipe CUDA_MPS_LOG_DIRECTORY=$2/log python3 -c "
import torch,time,os
ok=torch.cuda.is_available(); print('client gpu$1', 'available', ok, flush=True)
if ok:
    a=torch.randn(4096,4096,device='cuda'); t=time.time()
    for _ in range(200): a@a
    torch.cuda.synchronize(); print('client gpu$1 matmul ok', round(time.time()-t,2), flush=True)
    time.sleep(${3:-0})
" ; }
for g in 0 1; do d=/tmp/mps$g; rm -rf $d; mkdir -p $d/pipe $d/log; done
echo "== case 1: daemon per GPU, started together, clients together"
for g in 0 1; do CUDA_VISIBLE_DEVICES=$g CUDA_MPS_PIPE_DIRECTORY=/tmp/mps$g/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps$g/log nvidia-cuda-mps-control -d; echo "daemon $g rc=$?"; done
sleep 1
client 0 /tmp/mps0 8 & sleep 3; client 1 /tmp/mps1 0; wait
for g in 0 1; do echo "--- mps$g control.log"; tail -5 /tmp/mps$g/log/control.log; echo "--- server.log"; tail -8 /tmp/mps$g/log/server.log; done
for g in 0 1; do echo quit | CUDA_MPS_PIPE_DIRECTORY=/tmp/mps$g/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps$g/log nvidia-cuda-mps-control; done
sleep 2
echo "== case 2: daemons without CUDA_VISIBLE_DEVICES (each sees both GPUs)"
for g in 0 1; do d=/tmp/mps$g; rm -rf $d; mkdir -p $d/pipe $d/log; CUDA_MPS_PIPE_DIRECTORY=$d/pipe CUDA_MPS_LOG_DIRECTORY=$d/log nvidia-cuda-mps-control -d; done
sleep 1
client 0 /tmp/mps0 8 & sleep 3; client 1 /tmp/mps1 0; wait
for g in 0 1; do echo "--- mps$g server.log"; tail -6 /tmp/mps$g/log/server.log; done
for g in 0 1; do echo quit | CUDA_MPS_PIPE_DIRECTORY=/tmp/mps$g/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps$g/log nvidia-cuda-mps-control; done
sleep 2
echo "== case 3: one daemon, two clients on two GPUs"
d=/tmp/mps0; rm -rf $d; mkdir -p $d/pipe $d/log; CUDA_MPS_PIPE_DIRECTORY=$d/pipe CUDA_MPS_LOG_DIRECTORY=$d/log nvidia-cuda-mps-control -d
client 0 /tmp/mps0 8 & sleep 3; client 1 /tmp/mps0 0; wait
tail -6 $d/log/server.log
echo quit | CUDA_MPS_PIPE_DIRECTORY=$d/pipe CUDA_MPS_LOG_DIRECTORY=$d/log nvidia-cuda-mps-control
