"""`python -m pipeline.experiments run|analyze`: compare settings (pipeline/tools/experiments.py)."""

from pipeline.errors import run_cli
from pipeline.tools.experiments import main

if __name__ == "__main__":
    run_cli(main)
