"""Stage 2: extract text from organised files into a Hugging Face Arrow dataset. See pipeline/corpus.py."""

from pipeline.corpus import main
from pipeline.errors import run_cli

if __name__ == "__main__":
    run_cli(main)
