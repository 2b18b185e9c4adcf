"""python benchmarks/run_all.py [--quick] [--sections correctness overhead memory time_to_accuracy ddp]

Regenerates the head-to-head comparison in benchmarks/README.md: every section runs all of its
contenders in this one invocation, interleaved, and its figures, the machine, the library versions
and the command go into the README between the `run_all` markers, with PNG plots in
benchmarks/results/. The hand-written sections of the README are left alone.

Sections (each also runs on its own: python benchmarks/bench_<name>.py --help):
  correctness       relative gradient error of each accumulation method against a full batch   ~20 s
  overhead          loop throughput vs a plain loop, Accelerate's example and the Trainer        ~30 min
  memory            peak memory at equal effective batch: accumulation, grad ckpt, LoRA          ~10 min
  time_to_accuracy  SST-2 dev accuracy and wall time, ours vs the Trainer, LR policies           ~15 min
  ddp               every recipe on 2 DDP processes vs 1                                          ~20 min
(times on a 2-core CPU.) `--sections` reruns some of them; the README is rebuilt from every
section's saved JSON, so the other sections keep their last figures and their own dates.

--quick runs every section on tiny models, once, mostly in this process, into --output_dir (a
temporary folder by default): a smoke test of this code for CI, never a measurement.
"""

import argparse
import datetime
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ft_accum.testing import load_script
from ft_accum.testing.benchmarking import machine_info

ROOT = Path(__file__).resolve().parents[1]
# The sections are scripts of their own, loaded by path (benchmarks/ is a folder of scripts, not a package).
bench_correctness = load_script(ROOT / "benchmarks" / "bench_correctness.py")
bench_ddp = load_script(ROOT / "benchmarks" / "bench_ddp.py")
bench_loop_overhead = load_script(ROOT / "benchmarks" / "bench_loop_overhead.py")
bench_memory = load_script(ROOT / "benchmarks" / "bench_memory.py")
bench_time_to_accuracy = load_script(ROOT / "benchmarks" / "bench_time_to_accuracy.py")

OPTIONS = {"overhead_accumulation": (1, 4, 16)}
BEGIN, END = "<!-- run_all:begin -->", "<!-- run_all:end -->"
SECTIONS = {
    "correctness": lambda quick: bench_correctness.measure(quick),
    "overhead": lambda quick: bench_loop_overhead.measure(
        accumulations=(2,) if quick else OPTIONS["overhead_accumulation"],
        repeats=1 if quick else 3,
        quick=quick,
        micro_batches=6 if quick else 48,
    ),
    "memory": lambda quick: bench_memory.measure(1 if quick else 3, quick),
    "time_to_accuracy": lambda quick: bench_time_to_accuracy.measure(quick=quick),
    "ddp": lambda quick: bench_ddp.measure(1 if quick else 3, quick),
}
VARIANT_NAMES = {
    "plain": "plain PyTorch loop",
    "accelerate": "Accelerate `by_feature/gradient_accumulation.py` loop",
    "trainer": "Transformers Trainer",
    "recipe": "**ft-accum recipe** (`accelerate launch`)",
}


def sig(x: float) -> str:
    return f"{x:.1e}" if x < 1e-2 else f"{x:.2f}" if x < 100 else f"{x:.0f}"


def render_correctness(data: dict, plots: Path) -> str:
    columns = list(data["columns"])
    methods = list(dict.fromkeys(m for c in columns for m in data["columns"][c]))
    lines = ["| method | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for method in methods:
        cells = []
        for column in columns:
            r = data["columns"][column].get(method)
            if r is None:
                cells.append("n/a")
                continue
            cell = f"{r['relative_error']:.1e}"
            if abs(r["norm_ratio"] - 1) > 0.05:
                cell += f" (‖g‖ × {r['norm_ratio']:.2f})"
            cells.append(f"**{cell}**" if method == "ft-accum" else cell)
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_overhead(data: dict, plots: Path) -> str:
    out = []
    for task in dict.fromkeys(t["task"] for t in data["tables"]):
        tables = [t for t in data["tables"] if t["task"] == task]
        unit = tables[0]["unit"]
        head = " | ".join(f"accum {t['accumulation']}: {unit} | ratio" for t in tables)
        out += [
            f"**{task}** (median of {data['setup']['repeats']} repeats; ratio = median of per-repeat ratios to the plain loop)",
            "",
            f"| loop | {head} |",
            "|---" * (2 * len(tables) + 1) + "|",
        ]
        for variant in bench_loop_overhead.VARIANTS:
            cells = " | ".join(f"{t['median'][variant]:.1f} | {t['ratio_to_plain'][variant]:.3f}" for t in tables)
            out.append(f"| {VARIANT_NAMES[variant]} | {cells} |")
        to_trainer = [
            statistics.median(a["rate"] / b["rate"] for a, b in zip(t["runs"]["recipe"], t["runs"]["trainer"]))
            for t in tables
        ]
        out.append(
            "| **ft-accum recipe / Trainer** (median of per-repeat ratios) | "
            + " | ".join(f" | **{r:.3f}**" for r in to_trainer)
            + " |"
        )
        out += [
            "",
            "Per-repeat ratios to the plain loop: "
            + "; ".join(
                f"accum {t['accumulation']}: "
                + ", ".join(
                    f"{v} {'/'.join(f'{r:.2f}' for r in t['per_repeat_ratios'][v])}"
                    for v in bench_loop_overhead.VARIANTS[1:]
                )
                for t in tables
            ),
            "",
        ]
    plot_overhead(data, plots / "loop_overhead.png")
    out.append("![loop overhead](results/loop_overhead.png)")
    return "\n".join(out)


def render_memory(data: dict, plots: Path) -> str:
    base = next(iter(data["median_gb"].values()))
    lines = [
        f"{data['setup']['model']}, effective batch {data['setup']['effective_batch']} × {data['setup']['block_size']} tokens, "
        f"{data['setup']['updates']} updates, {data['setup']['measure']}, median of {data['setup']['repeats']}.",
        "",
        "| micro × accumulation, settings | peak RSS (GiB) | vs the first row | runs |",
        "|---|---|---|---|",
    ]
    for name, value in data["median_gb"].items():
        lines.append(
            f"| {name} | {value:.2f} | {value / base:.2f}× | {', '.join(f'{v:.2f}' for v in data['runs'][name])} |"
        )
    plot_bars({k: v for k, v in data["median_gb"].items()}, "peak RSS (GiB)", plots / "memory.png")
    lines += ["", "![peak memory](results/memory.png)"]
    return "\n".join(lines)


def render_time_to_accuracy(data: dict, plots: Path) -> str:
    if "skipped" in data:
        return f"Skipped: {data['skipped']}."
    s = data["setup"]
    lines = [
        f"{s['data']}: first {s['train_samples']} training sentences, one epoch; dev accuracy on {s['dev_samples']} sentences; {s['model']}, "
        f"max {s['max_seq_length']} tokens; seeds {', '.join(map(str, s['seeds']))}; base LR {data['base_learning_rate']:g} at batch 32.",
        "",
    ]
    if data["tuning"]:
        lines += [
            "LR tuning at 8 × 4 (seed "
            + str(s["seeds"][0])
            + "): "
            + ", ".join(f"{lr}: {r['accuracy']:.4f}" for lr, r in data["tuning"].items()),
            "",
        ]
    lines += [
        "| contender | updates | dev accuracy per seed | median | LR used | wall s (median) | train s (median) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in data["runs"].items():
        m = data["median"][name]
        learning_rates = {r.get("learning_rate") for r in runs if r.get("learning_rate")} or {
            data["base_learning_rate"]
        }
        accuracies = ", ".join(f"{r['accuracy']:.4f}" for r in runs)
        lines.append(
            f"| {name} | {m['updates']:.0f} | {accuracies} | {m['accuracy']:.4f} | "
            f"{', '.join(f'{lr:.2g}' for lr in sorted(learning_rates))} | {m['wall_seconds']:.0f} | {m['train_seconds']:.0f} |"
        )
    plot_scatter(data, plots / "time_to_accuracy.png")
    lines += ["", "![time to accuracy](results/time_to_accuracy.png)"]
    return "\n".join(lines)


def render_ddp(data: dict, plots: Path) -> str:
    lines = [
        "| recipe | 1 process | 2 processes | ratio 2 / 1 (median) | per-repeat ratios |",
        "|---|---|---|---|---|",
    ]
    for recipe, t in data["recipes"].items():
        lines.append(
            f"| {recipe} | {t['median']['1']:.1f} {t['unit']} | {t['median']['2']:.1f} {t['unit']} | {t['ratio']:.2f} | "
            f"{', '.join(f'{r:.2f}' for r in t['per_repeat_ratios'])} |"
        )
    return "\n".join(lines)


RENDER = {
    "correctness": render_correctness,
    "overhead": render_overhead,
    "memory": render_memory,
    "time_to_accuracy": render_time_to_accuracy,
    "ddp": render_ddp,
}
TITLES = {
    "correctness": "Correctness: relative gradient error against a true full batch",
    "overhead": "Loop overhead",
    "memory": "Peak memory at equal effective batch",
    "time_to_accuracy": "Time to accuracy on SST-2",
    "ddp": "DDP: 2 processes against 1, every recipe",
}


def plot_overhead(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(t["task"] for t in data["tables"]))
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        tables = [t for t in data["tables"] if t["task"] == task]
        width = 0.8 / len(bench_loop_overhead.VARIANTS)
        for i, variant in enumerate(bench_loop_overhead.VARIANTS):
            xs = [j + i * width for j in range(len(tables))]
            ax.bar(
                xs,
                [t["ratio_to_plain"][variant] for t in tables],
                width,
                label=VARIANT_NAMES[variant].replace("*", "").replace("`", ""),
            )
            for x, t in zip(xs, tables):
                ax.plot(
                    [x] * len(t["per_repeat_ratios"][variant]), t["per_repeat_ratios"][variant], "k.", markersize=3
                )
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(
            [j + 0.4 - width / 2 for j in range(len(tables))], [f"accum {t['accumulation']}" for t in tables]
        )
        ax.set_ylabel(f"throughput / plain loop ({tables[0]['unit']})")
        ax.set_title(task)
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bars(values: dict, ylabel: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh(list(values)[::-1], list(values.values())[::-1])
    ax.set_xlabel(ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scatter(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, runs in data["runs"].items():
        ax.scatter([r["wall_seconds"] for r in runs], [r["accuracy"] for r in runs], label=name)
    ax.set_xlabel("wall time of the whole command (s)")
    ax.set_ylabel("SST-2 dev accuracy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(results_dir: Path, quick: bool) -> str:
    """The README block, from every section JSON saved in results_dir."""
    parts = [BEGIN, "<!-- generated by benchmarks/run_all.py: edit that script, not this block -->", ""]
    if quick:
        parts += ["**--quick smoke run: tiny models, one repeat. These figures are not measurements.**", ""]
    for section in SECTIONS:
        path = results_dir / f"{section if section != 'overhead' else 'loop_overhead'}.json"
        if not path.exists():
            parts += [f"### {TITLES[section]}", "", "Not run yet.", ""]
            continue
        data = json.loads(path.read_text())
        run = data.get("run", {})
        machine = run.get("machine", {})
        parts += [
            f"### {TITLES[section]}",
            "",
            f"`{run.get('command', '?')}` — {run.get('date', '?')}, {run.get('seconds', 0) / 60:.1f} min; {machine.get('cpu', '?')}, "
            f"{machine.get('cores', '?')} cores, GPU: {machine.get('gpu') or 'none'}; torch {machine.get('torch')}, "
            f"transformers {machine.get('transformers')}, accelerate {machine.get('accelerate')}, Python {machine.get('python')}.",
            "",
            RENDER[section](data, results_dir),
            "",
        ]
    return "\n".join([*parts, END])


def write_readme(readme: Path, block: str) -> None:
    text = readme.read_text() if readme.exists() else "# Benchmarks\n\n"
    if BEGIN in text:
        text = text[: text.index(BEGIN)] + block + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    readme.write_text(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="tiny models, once: a smoke test of this code, not a measurement"
    )
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument(
        "--overhead_accumulation",
        nargs="+",
        type=int,
        default=list(OPTIONS["overhead_accumulation"]),
        help="accumulation steps of the overhead section",
    )
    parser.add_argument(
        "--render_only", action="store_true", help="rebuild the README block from the saved JSON, run nothing"
    )
    parser.add_argument(
        "--output_dir",
        type=Path,
        help="where README.md and results/ go (default: benchmarks/, or a temporary folder with --quick)",
    )
    args = parser.parse_args(argv)
    OPTIONS["overhead_accumulation"] = tuple(args.overhead_accumulation)
    output_dir = args.output_dir or (
        Path(tempfile.mkdtemp(prefix="run_all_quick_")) if args.quick else ROOT / "benchmarks"
    )
    results_dir = output_dir / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/run_all.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    for section in [] if args.render_only else args.sections:
        print(f"== {section}", file=sys.stderr)
        started = time.perf_counter()
        data = SECTIONS[section](args.quick)
        data["run"] = {
            "command": command.strip(),
            "date": datetime.date.today().isoformat(),
            "seconds": time.perf_counter() - started,
            "machine": machine_info(),
        }
        (results_dir / f"{section if section != 'overhead' else 'loop_overhead'}.json").write_text(
            json.dumps(data, indent=2)
        )
    write_readme(output_dir / "README.md", render(results_dir, args.quick))
    print(f"wrote {output_dir / 'README.md'}", file=sys.stderr)
    return output_dir


if __name__ == "__main__":
    main()
