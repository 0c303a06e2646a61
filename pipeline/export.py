"""`python -m pipeline.export CHECKPOINT`: a checkpoint to a Hugging Face folder (pipeline/train/export.py)."""

if __name__ == "__main__":
    from pipeline.offline import switch_offline

    switch_offline()  # everything is local: never wait on the network
    from pipeline.errors import run_cli
    from pipeline.train.export import main

    run_cli(main, finalize=False)  # it joins a process group: see errors.leave
