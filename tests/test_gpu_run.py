"""The prepared GPU run (`scripts/gpu_run.sh`) waits, unrun, for a machine with a GPU: these checks keep it
from rotting meanwhile (a renamed recipe, a new folder of the target's text that phase B would not read)."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_run.sh"
REGEN = ROOT / "train" / "shipped_data" / "smollm2-135m-instruct-regen" / "answers"


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_recipe_it_names_exists():
    names = set(re.findall(r"recipes/[\w./-]+\.yaml", SCRIPT.read_text()))
    assert names, "the script names no recipe"
    assert [n for n in names if not (ROOT / n).is_file()] == []


def test_phase_b_reads_every_folder_of_the_targets_text():
    text = SCRIPT.read_text()
    loops = re.findall(r"^for name in ([\w -]+); do$", text, flags=re.M)
    read = {name for loop in loops for name in loop.split()}
    shipped = {p.name for p in REGEN.iterdir() if p.is_dir()}
    assert shipped, "no shipped folder of the target's text"
    assert shipped - read == set(), "folders phase B would not read"
    assert read - shipped == set(), "folders the script names that are not shipped"
