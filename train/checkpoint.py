"""Resumable training state: accelerate's model / optimizer / RNG state plus the loop counters, written atomically.

Layout: ``<output_dir>/state/`` (the latest state; ``step.json`` holds the counters). A save goes to ``state.tmp``
and is renamed into place, so an interrupted save never leaves a half-written state behind.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from accelerate import Accelerator

STATE_DIR = "state"


def save_training_state(accelerator: Accelerator, output_dir: str | Path, counters: dict) -> None:
    """Collective: every rank calls it (accelerate gathers), the main process renames."""
    out = Path(output_dir)
    tmp, final, old = out / f"{STATE_DIR}.tmp", out / STATE_DIR, out / f"{STATE_DIR}.old"
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()  # every rank's RNG file is in tmp before it moves
    if accelerator.is_main_process:
        (tmp / "step.json").write_text(json.dumps(counters))
        if final.exists():
            if old.exists():  # a save interrupted after its last rename left both; final is the newer one
                shutil.rmtree(old)
            os.rename(final, old)
        os.rename(tmp, final)
        if old.exists():
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def load_training_state(accelerator: Accelerator, output_dir: str | Path) -> dict | None:
    """Restore the latest state if there is one; returns its counters (or None for a fresh start).

    ``state.old`` counts too: a save interrupted between its two renames leaves the previous state only there."""
    out = Path(output_dir)
    for state in (out / STATE_DIR, out / f"{STATE_DIR}.old"):
        if (state / "step.json").exists():
            accelerator.load_state(str(state))
            return json.loads((state / "step.json").read_text())
    return None
