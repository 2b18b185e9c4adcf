"""`accelerate launch [options] ft_accum/testing/recipe_runs.py RUNS.json`: several recipe runs in
one launch, one after another, in the same processes.

RUNS.json is a list of [recipe name, argument list] pairs, each argument list what
`recipes/<name>.py` would be given on the command line. Every process of the launch imports torch,
transformers and each recipe once (about 8 s of CPU each, most of a tiny test run), instead of once
per run; the suite's DDP equivalence tests of one recipe's variants, and its two FSDP equivalence
runs, share a launch this way (docs/tests.md).

Between runs, Accelerate's state is reset except its process group: each run builds a new
`Accelerator` on the launch's DDP group. A recipe leaves the group at the end of each run
(`Accelerator.end_training`); here only the last run does. Keeping the group avoids a second
rendezvous of the default group within one torchrun job (on the agent's store, which still holds
the first group's keys): that path is untried here, not shown to fail.

`recipe_runs.py RUNS.json EXITS.json` goes on past a run that ends in an error (SystemExit, as the
recipes leave on a refusal), and the main process writes each run's exit to EXITS.json: a list of
{"recipe", "code" (0 when it finished), "message", "seconds"}. A refusal that every rank makes at the same
point leaves the group in step; a crash on one rank alone does not, and the launch fails.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from unittest import mock


def run_all(runs: list[tuple[str, list[str]]], exits_path: Path | None = None) -> None:
    from accelerate.state import PartialState

    from ft_accum.testing import load_recipe
    from ft_accum.training.run_setup import reset_accelerate_state

    recipes, exits = {}, []

    def run(name, argv):
        started = time.perf_counter()
        if name not in recipes:
            recipes[name] = load_recipe(name)
        try:
            recipes[name].main(argv)
            exits.append({"recipe": name, "code": 0, "message": ""})
        except SystemExit as exc:
            if exits_path is None:
                raise  # an error leaves with SystemExit, as the recipe alone would
            code = exc.code if isinstance(exc.code, int) else 1
            exits.append({"recipe": name, "code": code, "message": "" if isinstance(exc.code, int) else str(exc.code)})
        exits[-1]["seconds"] = round(time.perf_counter() - started, 1)  # where a launch's time goes

    with mock.patch.object(PartialState, "destroy_process_group", lambda self, group=None: None):
        for name, argv in runs[:-1]:
            run(name, argv)
            reset_accelerate_state(keep_process_group=True)
    run(*runs[-1])  # the last run leaves the group, as every recipe run does (a refused one: at exit)
    if exits_path is not None and int(os.environ.get("RANK", "0")) == 0:
        exits_path.write_text(json.dumps(exits, indent=1))


if __name__ == "__main__":
    runs_path, *exits = sys.argv[1:]
    run_all(json.loads(Path(runs_path).read_text()), Path(exits[0]) if exits else None)
