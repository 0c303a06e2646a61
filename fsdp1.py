"""Stage 4: fine-tune with FSDP2. Launch with torchrun (or plain python for one process). See pipeline/train/.

    torchrun --standalone --nproc_per_node 4 fsdp1.py -e NAME -d hf_datasets/corpus -m org/model -b 2 --lr 2e-5
"""

from pipeline.offline import switch_offline

# No network at training time: set before any Hugging Face library is imported (they read these at import).
switch_offline()
# PyTorch's huge-page switch for host buffers (THP_MEM_ALLOC_ENABLE=1) is the user's to set, off here: on a real
# model's shape (SmolLM2-135M, CPU) a step with it grew from 3.3 to 3.9 s over a run, and fsdp1.py was 4% (full) to
# 8-12% (LoRA) slower with it than without (BENCHMARKS.md section 16); it paid only on a 2-layer toy under a 128k
# vocabulary.

from pipeline.errors import run_cli  # noqa: E402
from pipeline.train.cli import main  # noqa: E402

if __name__ == "__main__":
    run_cli(main, finalize=False)  # it joins a process group: see errors.leave
