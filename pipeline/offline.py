"""The Hugging Face libraries' offline switches. Each library reads them once, when it is imported, so a command that
must never reach for the network sets them before its first Hugging Face import (this module imports none)."""

import os

SWITCHES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def switch_offline() -> None:
    for switch in SWITCHES:
        os.environ[switch] = "1"
