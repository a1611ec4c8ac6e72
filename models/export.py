"""Export drafters to the folders serving engines load, or refuse with the reason (docs/exports.md has the engine
sources read, the launch flags and the full list of refusals).

Every ``save_*`` writes ``config.json``, the weights and a ``README.md`` saying which engine loads the folder and
with which flags, or writes nothing and raises ValueError with the reason. Each format is also a pair of pure
functions (config dict, state dict) so tests can check key names, shapes and dtypes on a meta-device model.

This module is the writing machinery every family's exports share: `write_folder`, `EngineExport` and the refusal
helpers. Each family's layouts live beside its drafter (``models/<family>_export.py``) and its declaration names
them (`infer.family.DrafterFamily.engine_exports`), so nothing here names a family.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import save_file


def write_folder(
    out_dir: str | Path,
    config: dict,
    tensors: dict[str, torch.Tensor],
    weights_name: str = "model.safetensors",
    readme: str | None = None,
) -> Path:
    """config.json, the weights (safetensors, or a torch pickle when ``weights_name`` ends in .pt) and README.md."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # copies: views of one storage (a shared head, fused experts) must not alias in the file
    tensors = {k: v.detach().cpu().clone(memory_format=torch.contiguous_format) for k, v in tensors.items()}
    if weights_name.endswith(".pt"):
        torch.save(tensors, out / weights_name)
    else:
        save_file(tensors, str(out / weights_name), metadata={"format": "pt"})
    if readme is not None:
        (out / "README.md").write_text(readme.strip() + "\n")
    return out


def refuse(reason: str | None) -> None:
    """Raise ValueError with ``reason`` when there is one: a layout's builders share their refusal function, so
    the reason a folder is refused and the error its builder raises are the same text."""
    if reason is not None:
        raise ValueError(reason)


class EngineExport(NamedTuple):
    """One engine folder of a trained drafter: written, or refused with the reason. A tuple so that a caller may
    unpack it (``for folder, write, what in ...``) as training does."""

    folder: str
    """The folder's name inside a checkpoint or a published folder, e.g. "export-sglang"."""
    write: Callable[[Path], Path] | None
    """Writes the folder at the path given and returns it; None when the layout refuses this drafter."""
    what: str
    """What the folder holds (written) or why there is none (refused), in words for a log or a model card."""


def refusal_of(build: Callable[[], object]) -> str | None:
    """The reason a layout refuses a drafter: every layout's builder raises ValueError with it, or
    returns."""
    try:
        build()
    except ValueError as e:
        return str(e)
    return None
