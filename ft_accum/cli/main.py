"""`ft-accum`: command-line tools that sit beside the recipes.

ft-accum ls
ft-accum cp text_classification my_task.py
ft-accum launch [accelerate launch options] recipes/text_classification.py [recipe flags]
ft-accum check recipes/my_recipe.py [recipe flags]
ft-accum plan --model gpt2-124m --task causal_lm --seq_len 512 --effective_batch_size 64 --gpu_memory 12GiB
ft-accum sweep recipes/configs/sweep_text_classification.yaml [--dry-run] [--time_budget 8h]
ft-accum report outputs/sweeps/text_classification [--out DIR]
ft-accum export outputs/instruction_tuning --format gguf [--outtype q8_0]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ft_accum.core.errors import one_line_errors


def plan_command(args: argparse.Namespace) -> int:
    from ft_accum.planner import memory_planner

    started = time.perf_counter()
    result = memory_planner.plan(
        args.config or args.model,
        task=args.task,
        seq_len=args.seq_len,
        effective_batch_size=args.effective_batch_size,
        gpu_memory_gib=memory_planner.parse_memory(args.gpu_memory),
        num_processes=args.num_processes,
        precision=args.precision,
        optimizer=args.optimizer,
        lora_r=args.lora_r,
        lora_target_modules=args.lora_target_modules,
        attention=args.attention,
        loss_path="logits" if args.no_chunked_loss else "chunked",
        load_in_4bit=args.load_in_4bit,
        offload_activations=args.offload_activations,
        host_memory_gib=memory_planner.parse_memory(args.host_memory) if args.offload_activations else None,
        gpu_tflops=args.gpu_tflops,
        pcie_gbps=args.pcie_gbps,
        preference_loss=args.loss,
        precompute_ref_log_probs=args.precompute_ref_log_probs,
        completion_length=args.completion_length,
        student_layers=args.student_layers,
        image_size=args.image_size,
        images_per_sample=args.images_per_sample,
        train_vision_tower=args.train_vision_tower,
        recipe=args.recipe,
    )
    result["seconds"] = round(time.perf_counter() - started, 1)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(format_plan(result))
    return 0


def sweep_command(args: argparse.Namespace) -> int:
    from ft_accum.cli.sweep import run_sweep

    state = run_sweep(args.sweep_file, dry_run=args.dry_run, time_budget=args.time_budget, worker=args.worker)
    return 1 if any(r["status"] == "failed" for r in state["runs"].values()) else 0


def report_command(args: argparse.Namespace) -> int:
    from ft_accum.cli.report import make_report

    print(f"wrote {make_report(args.output_dirs, args.out)}")
    return 0


def ls_command(args: argparse.Namespace) -> int:
    from ft_accum.training import recipe_files

    print("recipes (copy one out to edit: ft-accum cp <recipe> [my_task.py]):")
    for name in recipe_files.recipe_names():
        print(f"  {name:26s} {recipe_files.describe(recipe_files.shipped_recipe(name))}")
    print("Accelerate configs, hardware and precision (ft-accum cp <config> [folder]):")
    print("  " + "  ".join(recipe_files.accelerate_config_names()))
    print(f"shipped in {recipe_files.shipped_dir().resolve()}")
    return 0


def cp_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ft_accum.training import recipe_files

    destination = Path(args.destination)
    if args.name.endswith(".yaml"):
        print(f"wrote {recipe_files.copy_accelerate_config(args.name, destination)}")
        return 0
    written = recipe_files.copy_recipe(args.name, destination)
    print("wrote " + " and ".join(map(str, written)))
    config = f" --config {written[1]}" if len(written) > 1 else ""
    cpu = recipe_files.shipped_accelerate_config("cpu.yaml")
    print(
        f"run it (on a CPU; ft-accum ls lists the GPU configs): accelerate launch --config_file {cpu} {written[0]}{config}"
    )
    return 0


def format_plan(result: dict) -> str:
    """The candidates as an aligned table, the recommendation last, as a split and as a whole run."""
    from ft_accum.planner.launch_line import launch_line

    offloading = result.get("offload_activations")  # allowed; each candidate says whether it uses it
    lines = [
        f"{result['model']} · {result['task']} · {result['seq_len']} tokens · effective batch {result['effective_batch_size']} "
        f"· {result['precision']} · {result['optimizer']}"
        + (f" · LoRA r={result['lora_r']}" if result["lora_r"] else "")
        + (" · 4-bit base" if result.get("load_in_4bit") else "")
        + (" · activation offloading allowed" if offloading else "")
        + f" · card {result['gpu_memory_gib']:g} GiB (fits: {result['margin']})",
        "assumes the recipes' step: "
        + (
            f"the last {result['completion_length']} tokens' logits (the completion), β = 0, "
            if result["task"] == "grpo"
            else f"{result['loss_path']} loss, the frozen teacher beside its student of "
            f"{result.get('student_layers') or 'half its'} layers, "
            if result["task"] == "distillation"
            else f"{result['loss_path']} loss, "
        )
        + "fused AdamW, "
        + {
            "fused": "CUDA's fused SDPA attention (flash / memory-efficient)",
            "math": "T×T attention scores (math/eager)",
        }[result["attention"]],
        "",
        f"{'micro':>5} {'accum':>5} {'ckpt':>4} {'peak GiB':>9} {'weights+opt':>11} {'fits':>4} {'rel. speed':>10}"
        + (f" {'offload':>7} {'host GiB':>8}" if offloading else ""),
    ]
    for r in result["candidates"]:
        b = r["breakdown_gib"]
        lines.append(
            f"{r['per_device_train_batch_size']:>5} {r['gradient_accumulation_steps']:>5} {'on' if r['gradient_checkpointing'] else 'off':>4} "
            f"{r['peak_gib']:>9.2f} {b['parameters'] + b['optimizer_state']:>11.2f} {'yes' if r['fits'] else 'no':>4} {r['relative_throughput']:>10.2f}"
            + (f" {'on' if r['offload_activations'] else 'off':>7} {r['host_gib']:>8.2f}" if offloading else "")
        )
    if "image_tokens_per_image" in result:
        lines.insert(2, f"images: {result['images_per_sample']} of {result['image_size']} px per sample, "
                        f"{result['image_tokens_per_image']} tokens each (within the {result['seq_len']}); vision tower "
                        f"{result['vision_tower_parameters'] / 1e6:.0f}M parameters, "
                        + ("trained" if result["train_vision_tower"] else "frozen"))  # fmt: skip
    best = result["recommended"]
    lines.append("")
    if best:
        lines.append(
            f"recommended: --per_device_train_batch_size {best['per_device_train_batch_size']} --gradient_accumulation_steps "
            f"{best['gradient_accumulation_steps']}"
            + (" --gradient_checkpointing" if best["gradient_checkpointing"] else "")
            + f"  (predicted peak {best['peak_gib']:.2f} GiB)"
        )
        lines.append(f"as a run:    {launch_line(result)}")
        if best.get("offload_activations"):
            lines.append(
                f"offloading:  {best['host_gib']:.2f} GiB to host memory and back per micro-batch; its copies make the "
                f"split a predicted {best['offload_slowdown']:.0%} slower (at {result['pcie_gbps']:g} GB/s against "
                f"{result['gpu_tflops']:g} TFLOP/s; set --pcie_gbps and --gpu_tflops for your machine)"
            )
    else:
        lines.append(
            "nothing fits: try --precision bf16, --lora_r 16, --optimizer adamw_8bit, a shorter --seq_len, or a smaller model"
        )
    if offloading:
        lines.append("(offloading is tried only for the splits that do not fit without it: it only adds copies)")
    lines.append(
        f"(a prediction from a traced step on fake tensors, in {result['seconds']} s; see ft_accum/planner/tracing.py for its limits)"
    )
    return "\n".join(lines)


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a bad argument reported as one `error:` line (not usage plus a message), and no
    abbreviated flags: a typo is an error, never silently another flag. Subcommands inherit it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        raise SystemExit(f"error: {self.prog}: {message}; see {self.prog} --help")


def build_parser() -> argparse.ArgumentParser:
    from ft_accum.planner import configs, task_specs, throughput, tracing

    parser = OneLineParser(prog="ft-accum", description="Tools for exact gradient accumulation on one small GPU.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "check",
        help="check a recipe (your copy) keeps the template's contract: exact accumulation, exact resume, one-line errors",
        description="ft-accum check recipes/my_recipe.py [--rows N] [recipe flags] (docs/writing_a_recipe.md)",
    )
    commands.add_parser(
        "launch",
        help="accelerate launch, with a SIGTERM/Ctrl-C stop that waits for the checkpoint (docs/reliability.md)",
        description="ft-accum launch [accelerate launch options] recipes/<name>.py [recipe flags]: every option is "
        "accelerate launch's (see accelerate launch --help); the launcher passes a stop signal on to the recipe, "
        "waits until it has checkpointed and exits 143 (SIGTERM) or 130 (Ctrl-C).",
    )
    plan = commands.add_parser(
        "plan",
        help="predict peak GPU memory and pick micro-batch × accumulation × checkpointing",
        description="Trace one training step on fake tensors (no GPU, no weights, no download) and list every exact split of "
        "the effective batch with its predicted peak memory. Shipped configs: "
        + ", ".join(configs.shipped_config_names()),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    plan.add_argument(
        "--model",
        default="gpt2-124m",
        help="a shipped config name, a local folder or config.json, or a hub name (online)",
    )
    plan.add_argument(
        "--config", default=None, help="path to a config.json (overrides --model); the offline way for any model"
    )
    plan.add_argument(
        "--task",
        default="causal_lm",
        choices=task_specs.TASKS,
        help="; ".join(
            f"{name}: recipes/{spec.recipe}.py, a sample is {spec.sample}"
            for name, spec in task_specs.TASK_SPECS.items()
        ),
    )
    plan.add_argument("--seq_len", type=int, default=512, help="tokens per sample (padded length)")
    plan.add_argument("--effective_batch_size", type=int, default=64, help="samples (pairs) per optimizer update")
    plan.add_argument(
        "--loss",
        default="dpo",
        choices=task_specs.PREFERENCE_LOSSES,
        help="--task preference: dpo keeps a reference (the adapters off under LoRA, else a frozen copy)",
    )
    plan.add_argument(
        "--precompute_ref_log_probs",
        action="store_true",
        help="--task preference with dpo: the reference's log-probs precomputed, no frozen copy",
    )
    plan.add_argument(
        "--completion_length",
        type=int,
        default=None,
        help="--task grpo: the recipe's --max_completion_length, the tokens scored (default: all of --seq_len)",
    )
    plan.add_argument(
        "--student_layers",
        type=int,
        default=None,
        help="--task distillation: the student's layers, kept from the teacher's (default: half of them)",
    )
    plan.add_argument(
        "--image_size",
        type=int,
        default=None,
        help="--task vision_language: px of each (square) image the tower sees; default its own size (Qwen: 448)",
    )
    plan.add_argument(
        "--images_per_sample",
        type=int,
        default=1,
        help="--task vision_language: images per conversation (for SmolVLM's image splitting, its tiles + 1)",
    )
    plan.add_argument("--train_vision_tower", action="store_true", help="--task vision_language: train the tower too")
    plan.add_argument(
        "--recipe",
        default=None,
        help="the recipe file whose training_step is traced (default: the task's shipped recipe); your copy's path",
    )
    plan.add_argument("--gpu_memory", default="12GiB", help="memory of one card, e.g. 12GiB")
    plan.add_argument("--num_processes", type=int, default=1, help="GPUs (data parallel); the plan is per GPU")
    plan.add_argument("--precision", default="bf16-mixed", choices=tracing.PRECISIONS)
    plan.add_argument(
        "--optimizer",
        default="adamw",
        choices=tracing.OPTIMIZERS,
        help="adamw_8bit: 8-bit states (the recipes' --optim adamw_8bit, or adamw_torch_8bit for bf16 weights); "
        "adamw_4bit: torchao's, "
        "planned for comparison, not in the recipes",
    )
    plan.add_argument("--lora_r", type=int, default=None, help="plan a LoRA run of this rank (needs peft)")
    plan.add_argument("--lora_target_modules", default="all-linear")
    plan.add_argument(
        "--attention",
        default="fused",
        choices=tracing.ATTENTION,
        help="fused: CUDA's flash/memory-efficient SDPA (O(T) per head); math: T×T scores (eager attention, CPU runs)",
    )
    plan.add_argument(
        "--no_chunked_loss", action="store_true", help="plan the recipe's --no_chunked_loss (full logits) path"
    )
    plan.add_argument(
        "--load_in_4bit",
        action="store_true",
        help="QLoRA: frozen linear weights in NF4 (double quantized), bf16 embeddings and head; needs --lora_r",
    )
    plan.add_argument(
        "--offload_activations",
        action="store_true",
        help="allow saved activations in host memory: tried where a split does not fit without it, "
        "its copies priced against compute (reported as host GiB)",
    )
    plan.add_argument("--host_memory", default="32GiB", help="host RAM, for --offload_activations (80%% usable)")
    plan.add_argument(
        "--gpu_tflops",
        type=float,
        default=throughput.ASSUMED_GPU_TFLOPS,
        help="sustained training TFLOP/s of the card, to price offloading's copies (default %(default)g)",
    )
    plan.add_argument(
        "--pcie_gbps",
        type=float,
        default=throughput.ASSUMED_PCIE_GBPS,
        help="pinned host-GPU copy bandwidth in GB/s, to price offloading's copies (default %(default)g)",
    )
    plan.add_argument("--json", action="store_true", help="print machine-readable JSON instead of the table")
    plan.set_defaults(handler=plan_command)

    ls_parser = commands.add_parser("ls", help="list the recipes and Accelerate configs that ship with ft-accum")
    ls_parser.set_defaults(handler=ls_command)
    cp_parser = commands.add_parser(
        "cp",
        help="copy a shipped recipe (with its config) or Accelerate config out to edit, as torchtune's tune cp",
    )
    cp_parser.add_argument("name", help="a recipe (text_classification) or an Accelerate config (cpu.yaml)")
    cp_parser.add_argument(
        "destination",
        nargs="?",
        default=".",
        help="a new .py file (the config goes to configs/<its name>.yaml beside it) or a folder; default: here",
    )
    cp_parser.set_defaults(handler=cp_command)

    from ft_accum.cli import sweep

    sweep_parser = commands.add_parser(
        "sweep",
        help="run a grid or list of recipe runs one after another; rerun to resume",
        description=sweep.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sweep_parser.add_argument("sweep_file", help="the sweep YAML")
    sweep_parser.add_argument(
        "--dry-run",
        "--dry_run",
        dest="dry_run",
        action="store_true",
        help="print the runs and their status; run nothing",
    )
    sweep_parser.add_argument(
        "--time_budget",
        default=None,
        help="e.g. 8h: start no run that would not finish in the time left (estimated from finished runs)",
    )
    sweep_parser.add_argument(
        "--worker",
        action="store_true",
        help="a search only: one of several sweeps (GPUs, machines, a SLURM array) sharing the study's storage",
    )
    sweep_parser.set_defaults(handler=sweep_command)

    from ft_accum.cli import report

    report_parser = commands.add_parser(
        "report",
        help="plot and tabulate one or more runs (or a sweep) side by side",
        description=report.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report_parser.add_argument("output_dirs", nargs="+", help="run output_dirs, or a sweep's output_dir")
    report_parser.add_argument(
        "--out", default=None, help="where report.md and the PNGs go (default: <run>/report or <sweep>/report)"
    )
    report_parser.set_defaults(handler=report_command)

    from ft_accum.cli import export

    export.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:  # every option after it is accelerate launch's or the recipe's
        from ft_accum.cli.launcher import launch

        return launch(argv[1:])
    if argv[:1] == ["check"]:  # the flags after the recipe are the recipe's
        from ft_accum.cli import check

        with one_line_errors():
            return check.main(argv[1:])
    args = build_parser().parse_args(argv)
    for name in ("seq_len", "effective_batch_size", "num_processes", "lora_r"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise SystemExit(f"error: --{name} must be ≥ 1, got {value}")
    with one_line_errors():
        return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
