"""Are the shipped recipes' final weights bit-identical to an older commit's, on short fixed runs?

    python benchmarks/bit_identity.py bd92e56            # the commit before the library-layers change

A refactoring that moves code between modules must not change a single bit of what the recipes
train. This checks out REF in a temporary git worktree, runs each recipe there and here with the
same config and flags (its shipped config, 16 training rows, 2 updates, seed 42, one process, in
fp32 on the CPU), and compares the sha256 of every saved weight file in `final/`. It exits 1 if
any differs, and writes the table to results/bit_identity.json.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ["text_classification", "token_classification", "seq2seq", "image_classification", "causal_lm",
           "instruction_tuning"]  # fmt: skip
FLAGS = ["--max_train_samples", "16", "--max_eval_samples", "8", "--num_train_epochs", "1", "--max_train_steps", "2",
         "--seed", "42", "--report_to", "none", "--checkpointing_steps", "1000"]  # fmt: skip


def run_recipe(tree: Path, recipe: str, output_dir: Path) -> None:
    config = tree / "recipes" / "configs" / f"{recipe}.yaml"
    command = [sys.executable, str(tree / "recipes" / f"{recipe}.py"), "--config", str(config), *FLAGS,
               "--output_dir", str(output_dir)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree), "ACCELERATE_USE_CPU": "true", "ACCELERATE_MIXED_PRECISION": "no"}
    result = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{recipe} failed in {tree}:\n{result.stderr[-3000:]}")


def weight_hashes(output_dir: Path) -> dict[str, str]:
    files = sorted((output_dir / "final").glob("*.safetensors"))
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ref", help="the commit to compare with, e.g. bd92e56")
    parser.add_argument("--recipes", nargs="*", default=RECIPES)
    options = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", options.ref], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()  # fmt: skip
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    rows, identical = [], True
    with tempfile.TemporaryDirectory(prefix="bit-identity-") as tmp:
        old_tree = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old_tree), commit], cwd=ROOT, check=True,
                       capture_output=True)  # fmt: skip
        try:
            for recipe in options.recipes:
                hashes = {}
                for side, tree in (("old", old_tree), ("new", ROOT)):
                    run_recipe(tree, recipe, Path(tmp) / side / recipe)
                    hashes[side] = weight_hashes(Path(tmp) / side / recipe)
                same = bool(hashes["new"]) and hashes["old"] == hashes["new"]
                identical &= same
                rows.append({"recipe": recipe, "identical": same, **hashes})
                print(f"{recipe:22s} {'identical' if same else 'DIFFERENT'}  "
                      f"{', '.join(f'{k} {v[:16]}' for k, v in hashes['new'].items())}", flush=True)  # fmt: skip
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, capture_output=True)
    out = ROOT / "benchmarks" / "results" / "bit_identity.json"
    out.write_text(json.dumps({"command": f"python benchmarks/bit_identity.py {options.ref}", "old": commit,
                               "new": head, "flags": FLAGS, "recipes": rows}, indent=1) + "\n")  # fmt: skip
    print(f"{sum(r['identical'] for r in rows)} of {len(rows)} recipes bit-identical ({commit} → {head})")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
