"""Each recipe's shipped default, cut to 10 updates, in this tree and in another commit's: how far apart
are the final weights? (issue 54: moving the division before the backward must not change the updates.)

    python benchmarks/final_weights_against.py --commit af29a05 --out /tmp/weights

The other commit is checked out with `git worktree` under --out and run with its own `ft_accum` first
on PYTHONPATH; both runs go through `accelerate launch` on accelerate_configs/cpu.yaml. Prints, per
recipe, ‖w − w₀‖ / ‖w₀‖ over every tensor of final/*.safetensors.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from ft_accum.testing import final_weights, relative_error
from ft_accum.testing.benchmarking import launch_in_tree

ROOT = Path(__file__).resolve().parents[1]


def run_default(tree: Path, recipe: str, output_dir: Path, updates: int) -> None:
    """The recipe's docstring command (its config on cpu.yaml), cut to `updates` updates."""
    if (output_dir / "final").is_dir():
        return
    config = ["--config", str(tree / "recipes/configs" / f"{recipe}.yaml"), "--max_train_steps", str(updates)]
    launch_in_tree(tree, recipe, [*config, "--overwrite_output_dir", "true"], output_dir)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", required=True, help="the commit to compare with (e.g. af29a05)")
    parser.add_argument(
        "--out", type=Path, required=True, help="worktree and runs go here; reruns reuse finished runs"
    )
    parser.add_argument("--recipes", nargs="*", default=sorted(p.stem for p in (ROOT / "recipes").glob("*.py")))
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--only", choices=["theirs", "ours"], help="run one side only (e.g. the baseline first)")
    args = parser.parse_args(argv)
    base = args.out / f"tree-{args.commit}"
    if not base.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.commit], cwd=ROOT, check=True)
    results = {}
    for recipe in args.recipes:
        if args.only != "ours":
            run_default(base, recipe, args.out / "theirs" / recipe, args.updates)
        if args.only != "theirs":
            run_default(ROOT, recipe, args.out / "ours" / recipe, args.updates)
        if args.only is None:
            results[recipe] = relative_error(
                final_weights(args.out / "ours" / recipe), final_weights(args.out / "theirs" / recipe)
            )
            print(f"{recipe:26s} {results[recipe]:.2e}", flush=True)
    if results:
        print(json.dumps({"commit": args.commit, "updates": args.updates, "relative_difference": results}))


if __name__ == "__main__":
    sys.exit(main())
