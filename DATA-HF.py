"""Stage 2: extract text from organised files into a Hugging Face Arrow dataset. See pipeline/prep/corpus.py."""

from pipeline.errors import run_cli
from pipeline.prep.corpus import main

if __name__ == "__main__":
    run_cli(main)
