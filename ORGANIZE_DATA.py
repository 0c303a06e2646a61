"""Stage 1: split raw text files into folders balanced by bytes. See pipeline/prep/organize.py."""

from pipeline.errors import run_cli
from pipeline.prep.organize import main

if __name__ == "__main__":
    run_cli(main)
