"""`python -m pipeline.evaluate MODEL -d DATASET`: held-out loss and perplexity of a model or an adapter on a dataset,
packed as training packs it (pipeline/tools/evaluate.py). Also under torchrun, with a strategy, for a model one device
cannot hold."""

if __name__ == "__main__":
    from pipeline.offline import switch_offline

    switch_offline()  # everything is local: never wait on the network
    from pipeline.errors import run_cli
    from pipeline.tools.evaluate import main

    run_cli(main, finalize=False)  # it joins a process group: see errors.leave
