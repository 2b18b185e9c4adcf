"""The one against-a-commit tool: each recipe's shipped default, cut to 10 updates, in this tree and in
another commit's; how far apart are the final weights? A refactoring must not change what the recipes
train (issue 54: the division moved before the backward; issue 62: the setup in one call).

    python benchmarks/final_weights_against.py --commit af29a05 --out /tmp/weights
    python benchmarks/final_weights_against.py --commit bd92e56 --out /tmp/weights --sha256

The other commit is checked out with `git worktree` under --out and run with its own `ft_accum` first
on PYTHONPATH; both runs go through `accelerate launch` on accelerate_configs/cpu.yaml. Prints, per
recipe, ‖w − w₀‖ / ‖w₀‖ over every tensor of final/*.safetensors, and with --sha256 whether every
weight file is bit-identical (what the retired bit_identity.py checked; it exits 1 if one is not).
Writes the table to --output (default results/final_weights_<commit>.json).

Retired in issue 62 with their finished redesigns, their results kept: bit_identity.py (results/
bit_identity.json; this script with --sha256 does its check) and bench_loop_redesign.py (results/
loop_redesign*.json; rerun it from e732f24: `git worktree add /tmp/e732f24 e732f24`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from ft_accum.testing import final_weights, relative_error
from ft_accum.testing.benchmarking import launch_in_tree

ROOT = Path(__file__).resolve().parents[1]


def run_default(tree: Path, recipe: str, output_dir: Path, updates: int, flags: list[str]) -> None:
    """The recipe's docstring command (its config on cpu.yaml), cut to `updates` updates, with `flags`."""
    if (output_dir / "final").is_dir():
        return
    config = ["--config", str(tree / "recipes/configs" / f"{recipe}.yaml"), "--max_train_steps", str(updates)]
    launch_in_tree(tree, recipe, [*config, *flags, "--overwrite_output_dir", "true"], output_dir)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", required=True, help="the commit to compare with (e.g. af29a05)")
    parser.add_argument(
        "--out", type=Path, required=True, help="worktree and runs go here; reruns reuse finished runs"
    )
    parser.add_argument("--recipes", nargs="*", default=sorted(p.stem for p in (ROOT / "recipes").glob("*.py")))
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--sha256", action="store_true", help="also compare every weight file bit for bit")
    parser.add_argument(
        "--flags",
        default="",
        help="more recipe flags for both sides, e.g. '--max_eval_samples 4' (the evaluations, not the updates, "
        "are most of a short run's time)",
    )
    parser.add_argument("--output", type=Path, help="the JSON table (default results/final_weights_<commit>.json)")
    parser.add_argument("--only", choices=["theirs", "ours"], help="run one side only (e.g. the baseline first)")
    args = parser.parse_args(argv)
    base = args.out / f"tree-{args.commit}"
    if not base.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.commit], cwd=ROOT, check=True)
    results, identical = {}, {}
    for recipe in args.recipes:
        if args.only != "ours":
            run_default(base, recipe, args.out / "theirs" / recipe, args.updates, args.flags.split())
        if args.only != "theirs":
            run_default(ROOT, recipe, args.out / "ours" / recipe, args.updates, args.flags.split())
        if args.only is None:
            results[recipe] = relative_error(
                final_weights(args.out / "ours" / recipe), final_weights(args.out / "theirs" / recipe)
            )
            line = f"{recipe:26s} {results[recipe]:.2e}"
            if args.sha256:
                identical[recipe] = sha256s(args.out / "ours" / recipe) == sha256s(args.out / "theirs" / recipe)
                line += "  bit-identical" if identical[recipe] else "  NOT bit-identical"
            print(line, flush=True)
    if results:
        table = {"commit": args.commit, "updates": args.updates, "flags": args.flags, "relative_difference": results}
        table |= {"bit_identical": identical} if args.sha256 else {}
        print(json.dumps(table))
        output = args.output or ROOT / "benchmarks" / "results" / f"final_weights_{args.commit}.json"
        output.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), **table}, indent=2) + "\n")
    return 1 if identical and not all(identical.values()) else 0


def sha256s(output_dir: Path) -> dict[str, str]:
    """{weight file: its sha256} of a run's final/."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((output_dir / "final").glob("*.safetensors"))
    }


if __name__ == "__main__":
    sys.exit(main())
