"""`python -m pipeline.evaluate MODEL -d DATASET`: held-out loss and perplexity of a model or an adapter on a dataset,
packed as training packs it (pipeline/tools/evaluate.py). Also under torchrun, with a strategy, for a model one device
cannot hold."""

import os

if __name__ == "__main__":
    for switch in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):  # everything is local
        os.environ[switch] = "1"
    from pipeline.errors import run_cli
    from pipeline.tools.evaluate import main

    run_cli(main, finalize=False)  # it joins a process group: see errors.leave
