"""`accelerate launch --config_file FSDP.yaml ft_accum/cli/fsdp_end_of_run.py RECIPE NUM_LAYERS [flags]`:
one run of RECIPE on CPU processes under FSDP, for `ft-accum check` only.

Accelerate's FSDP plugin is switched on for CPU process groups (ft_accum.training.fsdp_on_cpu),
which the product otherwise refuses; a recipe that offers --merge_lora merges; NUM_LAYERS > 0 keeps
that many layers of each model (`ft-accum check --num_layers`). What the check wants to see is that
the end of the run, where every rank must still make every model call, ends.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    from ft_accum.cli.check import first_layers_only, load_recipe
    from ft_accum.training.fsdp_on_cpu import switch_on

    recipe_path, num_layers, *flags = argv
    switch_on()
    recipe = load_recipe(Path(recipe_path))
    task_class = getattr(recipe, "TaskArguments", None)
    if task_class and any(f.name == "merge_lora" for f in dataclasses.fields(task_class)):
        flags.append("--merge_lora")
    with first_layers_only(int(num_layers) or None):
        recipe.main(flags)


if __name__ == "__main__":
    main(sys.argv[1:])
