import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# 2-core machines: one intra-op thread per test process keeps timings stable and avoids oversubscription
torch.set_num_threads(int(os.environ.get("DRAFTERS_TEST_THREADS", "2")))
# the precision policy's measurements of tiny test models stay out of the user's cache (subprocesses inherit it)
os.environ.setdefault("DRAFTERS_PRECISION_CACHE", tempfile.mkdtemp(prefix="drafters-precision-"))

REFERENCE_NAME = "smollm2-135m-instruct"


def tiny_llama(vocab: int = 97, layers: int = 2, hidden: int = 32, seed: int = 0, **kw):
    """A random fp32 Llama small enough that every test can build its own."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        **kw,
    )
    model = LlamaForCausalLM(cfg).eval()
    # sharpen the random logits so greedy decisions are far from numerical ties
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="session")
def tiny_target():
    from models.target import TargetModel

    return TargetModel(tiny_llama(seed=0))


@pytest.fixture(scope="session")
def tiny_draft():
    return tiny_llama(layers=1, hidden=32, seed=1)


@pytest.fixture(scope="session")
def tiny_recipe(tmp_path_factory):
    """A tiny target directory (model + tokenizer) and train / held-out text jsonl files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from eval.stdlib_corpus import stdlib_root

    root = tmp_path_factory.mktemp("eagle3_recipe")
    files = sorted(stdlib_root().glob("*.py"))[:24]
    texts = [f.read_text(encoding="utf-8", errors="ignore") for f in files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    target_dir = root / "target"
    hf_tok.save_pretrained(target_dir)
    tiny_llama(vocab=len(hf_tok), layers=2, hidden=32).save_pretrained(target_dir)

    def chunks(ts):
        for t in ts:
            lines = t.splitlines(keepends=True)
            for i in range(0, len(lines), 12):
                if "".join(lines[i : i + 12]).strip():
                    yield {"text": "".join(lines[i : i + 12])}

    for name, ts in (("train", texts[:20]), ("heldout", texts[20:])):
        with open(root / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in list(chunks(ts))[:120])
    return root


# `accelerate launch` configs (recipes/accelerate/) by engine; the GPU ones run here on two CPU ranks
ENGINE_CONFIGS = {
    "ddp": "cpu_2proc.yaml",
    "zero2": "deepspeed_zero2.yaml",
    "zero3": "deepspeed_zero3.yaml",
    "fsdp": "fsdp_8gpu.yaml",
}


def run_entry(script: str, args: list[str], launcher: str = "python", **popen) -> subprocess.Popen:
    """Start ``train/<script>`` in a fresh process (one intra-op thread per rank): ``launcher`` "python" (one
    process), "torchrun" (two ranks) or an engine of `ENGINE_CONFIGS` (two CPU ranks through ``accelerate launch``
    with that config as shipped: only the process count is overridden; the recipe's train.mixed_precision decides
    the precision). The caller waits on it (``communicate``)."""
    bin_dir, entry = Path(sys.executable).parent, str(ROOT / "train" / script)
    if launcher == "python":
        cmd = [sys.executable, entry]
    elif launcher == "torchrun":
        cmd = [str(bin_dir / "torchrun"), "--nproc_per_node", "2", entry]
    else:
        config = str(ROOT / "recipes" / "accelerate" / ENGINE_CONFIGS[launcher])
        cmd = [str(bin_dir / "accelerate"), "launch", "--config_file", config, "--num_processes", "2", entry]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [*cmd, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
    )


def run_to_end(script: str, args: list[str], launcher: str = "python") -> str:
    """`run_entry` waited for: its stdout; fails the test with the end of stderr if it exits non-zero."""
    proc = run_entry(script, args, launcher)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return out


def tiny_run_args(recipe: str, root: Path, out: Path) -> list[str]:
    """A shipped SmolLM2 recipe (``recipes/smollm2-135m/<recipe>.yaml``) pointed at `tiny_recipe`'s target and raw-text
    data, writing to ``out``: the overrides every recipe test starts from."""
    return [
        "--config",
        str(ROOT / "recipes" / "smollm2-135m" / f"{recipe}.yaml"),
        f"target.name_or_path={root / 'target'}",
        "target.device=cpu",
        *(
            f"{split}.{key}"
            for split, name in (("data", "train"), ("eval_data", "heldout"))
            for key in (
                f"path={root / f'{name}.jsonl'}",
                "format=text",
                "max_length=96",
                f"cache_dir={root / 'hf-cache'}",
            )
        ),
        f"train.output_dir={out}",
        # tests compare numbers, so they pin fp32 (the automatic choices pick bf16 on some CPUs);
        # tests/test_precision.py runs the automatic bf16 paths on every machine
        "target.dtype=float32",
        "train.mixed_precision=fp32",
        "train.batch_size=2",
        "train.lr=3e-3",
        "train.log_every=2",
        "train.eval_samples=4",
        "train.save_every=0",
        "report.prompt_source=eval_data",
        "report.prompts=2",
        "report.prompt_tokens=24",
        "report.max_new_tokens=10",
    ]


def recipe_args(root: Path, out: Path, *extra: str) -> list[str]:
    """Command-line arguments that run the reference EAGLE-3 recipe on `tiny_recipe`'s target and data."""
    return [
        *tiny_run_args("eagle3", root, out),
        "stdlib_corpus_dir=null",
        "train.features=online",
        "train.grad_accum=1",
        "train.max_train_samples=null",
        "train.epochs=1",
        "drafter.draft_vocab_size=128",
        "drafter.ttt_steps=3",
        "report.chain_k=3",
        "report.tree_top_k=2",
        "report.tree_depth=3",
        "report.tree_total_tokens=6",
        "report.draft_model=null",
        "report.drafter_dir=null",
        "report.output_dir=null",
        "report.temperatures=[0.0, 1.0]",
        "self_distill.samples=6",
        "self_distill.prompt_tokens=16",
        "self_distill.new_tokens=12",
        "self_distill.batch_size=4",
        *extra,
    ]
