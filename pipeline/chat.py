"""`python -m pipeline.chat MODEL`: generate through the chat template (pipeline/tools/chat.py)."""

import os

if __name__ == "__main__":
    os.environ["HF_HUB_OFFLINE"] = "1"  # everything is local: never wait on the network
    from pipeline.errors import run_cli
    from pipeline.tools.chat import main

    run_cli(main)
