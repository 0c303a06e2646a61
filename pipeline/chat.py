"""`python -m pipeline.chat MODEL`: generate through the chat template (pipeline/tools/chat.py)."""

if __name__ == "__main__":
    from pipeline.offline import switch_offline

    switch_offline()  # everything is local: never wait on the network
    from pipeline.errors import run_cli
    from pipeline.tools.chat import main

    run_cli(main)
