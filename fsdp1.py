"""Stage 4: fine-tune with FSDP2. Launch with torchrun (or plain python for one process). See pipeline/train/.

    torchrun --standalone --nproc_per_node 4 fsdp1.py -e NAME -d hf_datasets/corpus -m org/model -b 2 --lr 2e-5
"""

import os

# No network at training time: set before any Hugging Face library is imported (they read these at import).
for _switch in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_switch] = "1"
# Host buffers of 2 MB and more on transparent huge pages (PyTorch's own switch, read at its first allocation):
# every step allocates and frees hundreds of MB of host memory when training on CPU or with CPU offload, and
# faulting it in 4 KB pages cost a fifth of a CPU step (BENCHMARKS.md). Freed memory still goes back to the OS.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from pipeline.errors import run_cli  # noqa: E402
from pipeline.train.cli import main  # noqa: E402

if __name__ == "__main__":
    run_cli(main, finalize=False)  # it joins a process group: see errors.leave
