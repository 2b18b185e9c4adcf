"""`ft-accum check recipes/my_recipe.py [recipe flags]`: does a recipe keep the template's contract?

docs/writing_a_recipe.md states the contract; this runs it on your copy, in this process, on a few
rows of whatever data and model your flags (or the recipe's config) give:

1. A bad flag is refused with one `error:` line, not a traceback.
2. (micro 8 × accumulation 1) and (micro 2 × accumulation 4) give the same updates: per-update
   loss, gradient norm and counts, and final weights, within `TOLERANCE` (relative). The rows
   (`--rows`, 20 by default) leave a short last window (8 + 8 + 4). Evaluation (before training
   and after the epoch) runs on the first 4 validation rows (`--eval_rows`): it is run, not compared.
3. A run resumed from the checkpoint before its last update (the short window) ends bit-identical
   to the uninterrupted run.
4. The end of the run (evaluation, the sample, the merge: every model call after the last update)
   ends under FSDP on 2 CPU processes, on the shipped accelerate_configs/fsdp.yaml with Accelerate's
   FSDP plugin switched on for CPU (inside the check only), or the recipe refuses FSDP in one line.
   Under FSDP every rank must make every model call: a call on the main process only waits for the
   others for ever, and here becomes an error after --ddp_timeout (60 s unless the flags give one).
   `--skip_fsdp` skips it.

The runs are fp32, whatever ACCELERATE_MIXED_PRECISION the shell exports (the bounds are fp32's),
and use SGD without clipping, warm-up, weight decay or LR scaling, so an update is linear in
its gradient and a wrong scale shows at its size (AdamW would hide most of it). Every module is
kept in eval mode, so dropout draws no masks: two splits of the same batch draw different ones,
and the check is about the loop's arithmetic, not the model's noise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TOLERANCE = 1e-5  # fp32 runs that differ only in summation order agree to ~1e-7
FSDP_TIMEOUT = 60  # --ddp_timeout of the FSDP run: a process left waiting stops it after this long


@dataclass
class Result:
    name: str
    passed: bool
    measured: str


def load_recipe(path: Path):
    from ft_accum.training.recipe_modules import load_recipe_module

    module = load_recipe_module(path)
    if not callable(getattr(module, "main", None)):
        raise SystemExit(f"error: {path} has no main(argv) function; see docs/writing_a_recipe.md")
    return module


@contextlib.contextmanager
def modules_in_eval_mode():
    """`model.train()` leaves every module in eval mode: no dropout masks (see the module docstring)."""
    import torch

    train = torch.nn.Module.train
    torch.nn.Module.train = lambda self, mode=True: train(self, False)
    try:
        yield
    finally:
        torch.nn.Module.train = train


@contextlib.contextmanager
def first_layers_only(num_layers: int | None):
    """Every transformers model built in this block keeps only its first `num_layers` layers (of
    each stack: an encoder-decoder's encoder and decoder). The checked arithmetic is the loop's,
    which one layer exercises as well as thirty; the weights load for the layers kept. The one
    exception is the bundled SmolLM2's conversion, whose cached copy every later run loads."""
    if not num_layers:
        yield
        return
    from transformers import PreTrainedModel

    from ft_accum.data.offline_assets import CONVERTING_BUNDLED_MODEL

    init = PreTrainedModel.__init__

    def shrink(self, config, *args, **kwargs):
        if CONVERTING_BUNDLED_MODEL.get():  # the cached SmolLM2 that every later run loads stays whole
            return init(self, config, *args, **kwargs)
        # Model classes call this first, then build config.num_hidden_layers layers (T5: num_layers).
        for name in ("num_hidden_layers", "num_layers", "num_decoder_layers"):
            if isinstance(getattr(config, name, None), int) and getattr(config, name) > num_layers:
                setattr(config, name, num_layers)
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[:num_layers]
        init(self, config, *args, **kwargs)

    PreTrainedModel.__init__ = shrink
    try:
        yield
    finally:
        PreTrainedModel.__init__ = init


def run(recipe_path: Path, argv: list[str]) -> SystemExit | None:
    """One in-process run of the recipe (a fresh module and Accelerate state each time), in fp32 whatever
    the shell's ACCELERATE_MIXED_PRECISION says: the check's bounds are fp32's (bf16's summation order
    alone moves a gradient norm by about 1e-4)."""
    from unittest import mock

    from ft_accum.training.run_setup import reset_accelerate_state

    try:
        with mock.patch.dict(os.environ, {"ACCELERATE_MIXED_PRECISION": "no"}):
            load_recipe(recipe_path).main(argv)
    except SystemExit as exc:
        return exc
    finally:
        reset_accelerate_state()
    return None


def final_weights(output_dir: Path) -> dict:
    """The saved final weights: the model's, or a LoRA run's adapter."""
    from safetensors.torch import load_file

    final = Path(output_dir) / "final"
    adapter = final / "adapter_model.safetensors"
    return load_file(str(adapter if adapter.exists() else final / "model.safetensors"))


def relative_error(a: dict, b: dict) -> float:
    """‖a − b‖ / ‖b‖ over all tensors."""
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5 if den else num**0.5


def records(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line]


def largest_relative_difference(ours: list[dict], theirs: list[dict], key: str) -> float:
    return max(abs(a[key] - b[key]) / max(abs(b[key]), 1e-12) for a, b in zip(ours, theirs))


def check(
    recipe_path: Path,
    flags: list[str],
    rows: int = 20,
    num_layers: int | None = None,
    eval_rows: int = 4,
    fsdp: bool = True,
) -> list[Result]:
    results = []
    failed = run(recipe_path, ["--no_such_flag_for_the_check=1"])
    message = str(failed.code) if failed else ""
    results.append(
        Result(
            "a bad flag: one error line",
            message.startswith("error: ") and "\n" not in message,
            message[:70] or "accepted without an error",
        )
    )

    work = Path(tempfile.mkdtemp(prefix="ft-accum-check-"))
    updates = -(-rows // 8)
    common = [*flags, "--optim", "sgd", "--max_grad_norm", "0", "--num_warmup_steps", "0", "--weight_decay", "0",
              "--lr_scaling", "none", "--num_train_epochs", "1", "--max_eval_samples", str(eval_rows), "--max_train_samples",
              str(rows), "--effective_batch_size", "8", "--report_to", "none",
              # the rows' own updates, not a config's max_train_steps
              "--max_train_steps", str(updates)]  # fmt: skip
    # The resume runs the last update only (the cheapest, and the short window after a restore); the
    # (2 × 4) run writes the checkpoint it starts from, the (8 × 1) run writes none.
    resume_step = max(1, updates - 1)
    checkpoints = {
        "8x1": ["--checkpointing_steps", str(updates + 1)],
        "2x4": ["--checkpointing_steps", str(resume_step)],
    }
    try:
        with modules_in_eval_mode(), first_layers_only(num_layers):
            outcomes = {}
            for name, micro in (("8x1", 8), ("2x4", 2)):
                outcomes[name] = run(recipe_path, [*common, *checkpoints[name], "--per_device_train_batch_size",
                                                   str(micro), "--output_dir", str(work / name)])  # fmt: skip
            if any(outcomes.values()):
                bad = next(f"{k}: {v.code}" for k, v in outcomes.items() if v)
                return [*results, Result("the recipe runs at (8 × 1) and (2 × 4)", False, bad[:200])]
            full, split = records(work / "8x1"), records(work / "2x4")
            counts_equal = [(r["samples_seen"], r["tokens_seen"]) for r in full] == [
                (r["samples_seen"], r["tokens_seen"]) for r in split
            ]
            results.append(
                Result(
                    "(8 × 1) = (2 × 4): updates and counts",
                    counts_equal and len(full) == len(split),
                    f"{len(full)} and {len(split)} updates, samples {[r['samples_seen'] for r in full]}"
                    + ("" if counts_equal else f" vs {[r['samples_seen'] for r in split]} (tokens differ)"),
                )
            )
            for key in ("loss", "grad_norm"):
                error = largest_relative_difference(split, full, key)
                results.append(
                    Result(
                        f"(8 × 1) = (2 × 4): {key} of every update", error <= TOLERANCE, f"relative error {error:.1e}"
                    )
                )
            error = relative_error(final_weights(work / "2x4"), final_weights(work / "8x1"))
            results.append(
                Result(
                    "(8 × 1) = (2 × 4): final weights",
                    error <= TOLERANCE,
                    f"relative error {error:.1e} (bound {TOLERANCE:.0e})",
                )
            )

            resumed = work / "resumed"
            (resumed / "checkpoints").mkdir(parents=True)
            step = f"step_{resume_step:06d}"
            shutil.copytree(work / "2x4" / "checkpoints" / step, resumed / "checkpoints" / step)
            outcome = run(recipe_path, [*common, *checkpoints["2x4"], "--per_device_train_batch_size", "2",
                                        "--output_dir", str(resumed), "--resume_from_checkpoint", "latest"])  # fmt: skip
            name = f"resume from update {resume_step}: bit-identical"
            if outcome:
                results.append(Result(name, False, str(outcome.code)[:200]))
            else:
                ours, theirs = final_weights(resumed), final_weights(work / "2x4")
                worst = max(float((ours[k].double() - theirs[k].double()).abs().max()) for k in theirs)
                results.append(Result(name, worst == 0.0, f"max |difference| {worst:.1e}"))
        if fsdp:
            results.append(end_of_run_under_fsdp(recipe_path, flags, work / "engine", rows, eval_rows, num_layers))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def end_of_run_under_fsdp(
    recipe_path: Path, flags: list[str], work: Path, rows: int, eval_rows: int, num_layers: int | None
) -> Result:
    """Check 4: one update and the end of the run under FSDP on 2 CPU processes (see the module docstring)."""
    import yaml

    name = "FSDP, 2 CPU processes: the end of the run ends"
    from ft_accum.training.recipe_files import accelerate_configs_dir

    config = yaml.safe_load((accelerate_configs_dir() / "fsdp.yaml").read_text()) | {"mixed_precision": "no"}
    work.mkdir(parents=True, exist_ok=True)
    (work / "fsdp.yaml").write_text(yaml.safe_dump(config))
    with socket.socket() as s:  # a free port for the launch's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # A --ddp_timeout among the recipe flags comes later and wins.
    run_flags = ["--ddp_timeout", str(FSDP_TIMEOUT), *flags, "--max_train_samples", str(rows),
                 "--max_eval_samples", str(eval_rows), "--max_train_steps", "1", "--per_device_train_batch_size", "2",
                 "--effective_batch_size", "8", "--report_to", "none", "--output_dir", str(work / "fsdp")]  # fmt: skip
    runner = Path(__file__).with_name("fsdp_end_of_run.py")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(work / "fsdp.yaml"),
               "--num_processes", "2", "--main_process_port", str(port), str(runner), str(recipe_path),
               str(num_layers or 0), *run_flags]  # fmt: skip
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30 * FSDP_TIMEOUT)
    errors = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error: ")]
    if result.returncode == 0:
        return Result(name, True, f"exit 0 in {time.monotonic() - started:.0f} s")
    if errors and errors[0].startswith("error: FSDP cannot serve"):
        return Result(name, True, f"refused in one line: {errors[0][7:90]}")
    return Result(name, False, (errors[0] if errors else result.stderr.strip()[-300:])[:300])


def format_table(results: list[Result]) -> str:
    width = max(len(r.name) for r in results)
    lines = [f"  {'check'.ljust(width)}  result  measured"]
    lines += [f"  {r.name.ljust(width)}  {'pass' if r.passed else 'FAIL'}    {r.measured}" for r in results]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="ft-accum check",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        usage="ft-accum check recipes/my_recipe.py [--rows N] [--eval_rows N] [--num_layers N] [--skip_fsdp] "
        "[recipe flags]",
    )
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--rows", type=int, default=20, help="training rows for the runs (default 20: 8 + 8 + 4)")
    parser.add_argument(
        "--eval_rows",
        type=int,
        default=4,
        help="validation rows each evaluation runs on (default 4; 1 is faster where one row gives a batch)",
    )
    parser.add_argument(
        "--num_layers",
        type=int,
        default=None,
        help="keep only the first N layers of each transformers model (faster; the loop is checked the same)",
    )
    parser.add_argument(
        "--skip_fsdp",
        action="store_true",
        help="skip check 4, the end of the run under FSDP on 2 CPU processes (a launch of its own, ~30 s)",
    )
    options, flags = parser.parse_known_args(argv)
    if not options.recipe.is_file():  # a shipped recipe's name; else the one-line error naming them
        from ft_accum.training.recipe_files import shipped_recipe

        options.recipe = shipped_recipe(options.recipe.name)
    results = check(options.recipe, flags, options.rows, options.num_layers, options.eval_rows, not options.skip_fsdp)
    print(f"ft-accum check {options.recipe}")
    print(format_table(results))
    failed = [r for r in results if not r.passed]
    print(
        f"{len(results) - len(failed)} of {len(results)} passed"
        + (": the recipe breaks the contract" if failed else "")
    )
    sys.stdout.flush()
    return 1 if failed else 0
