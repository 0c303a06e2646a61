"""Stage 3: put a model into the local Hugging Face cache and verify it on the meta device. See pipeline/prep/hub.py."""

from pipeline.errors import run_cli
from pipeline.prep.hub import main

if __name__ == "__main__":
    run_cli(main)
