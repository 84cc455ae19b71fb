"""Run ``mt3d.train`` with every local rank on the first GPU: a smoke run of a multi-rank layout
(cp 2, ep 2) on a machine with one GPU, under torchrun. Each rank reports local rank 0, so mt3d
places it on GPU 0 (and sees one rank per host); NCCL decides whether two ranks may share a GPU.

    python -m torch.distributed.run --nproc_per_node 2 launch/gpu_share.py --config C.json --set ...
"""

import os
import runpy
import sys

if __name__ == "__main__":
    os.environ["LOCAL_RANK"] = "0"
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    sys.argv[0] = "mt3d.train"
    runpy.run_module("mt3d.train", run_name="__main__", alter_sys=True)
