"""A training run: preflight, the Trainer and its loop, checkpoints, telemetry, export, and fsdp1.py's command line."""
