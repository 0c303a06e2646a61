"""`python -m pipeline.tiny`: the random-weight tiny model and tokenizer (pipeline/prep/tiny.py)."""

from pipeline.errors import run_cli
from pipeline.prep.tiny import main

if __name__ == "__main__":
    run_cli(main)
