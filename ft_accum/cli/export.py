"""ft-accum export RUN_DIR --format gguf [--outtype f16|bf16|q8_0|f32] [--output FILE] [--overwrite] [--no_verify]

Write a finished run's model (final/: a full model, or a LoRA adapter merged into its unquantized
base) as a GGUF file for llama.cpp, Ollama and LM Studio, with an Ollama Modelfile beside it, and
check the file in a real llama.cpp (the [export] extra: pip install -e ".[export]"): greedy top-1
tokens on three prompts, through the chat template for a chat model, against the Hugging Face model.
Without the extra, the check is transformers' own GGUF reader (logits against the model).

Llama-architecture models (SmolLM2, TinyLlama, Llama 2 and 3). K-quants (Q4_K_M, Q5_K_M, ...) need
llama.cpp's own quantizer: export f16, then `llama-quantize model-f16.gguf model-q4_k_m.gguf Q4_K_M`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ft_accum.core.errors import ConfigError
from ft_accum.core.integrity import sha256_of


def add_parser(commands) -> None:
    from ft_accum.export.gguf_file import OUTTYPES

    parser = commands.add_parser(
        "export",
        help="write a run's model as a GGUF (llama.cpp, Ollama, LM Studio) with a Modelfile, checked in llama.cpp",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", help="a finished run's --output_dir (it holds final/), or a saved model folder")
    parser.add_argument("--format", required=True, choices=["gguf"], help="the output format")
    parser.add_argument(
        "--outtype",
        default="f16",
        choices=OUTTYPES,
        help="weight type: f16 (default; exact up to 16-bit rounding), bf16, q8_0 (gguf's quantizer, half the size) "
        "or f32; norms are F32 in every case",
    )
    parser.add_argument("--output", default=None, help="the GGUF file (default: RUN_DIR/gguf/<recipe>-<outtype>.gguf)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    parser.add_argument(
        "--no_verify", dest="verify", action="store_false", help="skip the check in llama.cpp (or in transformers)"
    )
    parser.add_argument(
        "--verify_tokens", type=int, default=32, help="greedy tokens compared per prompt in llama.cpp (default 32)"
    )
    parser.add_argument(
        "--base_model",
        default=None,
        help="the unquantized base to merge a LoRA adapter into (default: the base the adapter names)",
    )
    parser.add_argument(
        "--system_prompt",
        default=None,
        help="the Modelfile's SYSTEM (default: the system turn every training conversation began with, if any)",
    )
    parser.set_defaults(handler=export_command)


def default_output(run_dir: Path, recipe: str, outtype: str) -> Path:
    return Path(run_dir) / "gguf" / f"{recipe}-{outtype}.gguf"


def export_command(args: argparse.Namespace) -> int:
    from ft_accum.export import gguf_file, source_model, vocab
    from ft_accum.training import model_card

    started = time.perf_counter()
    run_dir = Path(args.run_dir)
    final = source_model.final_dir(run_dir)  # a missing final/ fails before any model loads
    run = model_card.read_record(run_dir, model_card.RUN_CONFIG_FILE)
    recipe = run.get("recipe") or final.parent.name
    output = Path(args.output) if args.output else default_output(run_dir, recipe, args.outtype)
    if output.exists() and not args.overwrite:
        raise ConfigError(f"{output} already exists; pass --overwrite to replace it, or choose another --output")
    if args.verify_tokens < 1:
        raise ConfigError(f"--verify_tokens must be ≥ 1, got {args.verify_tokens}")
    from transformers import AutoTokenizer

    source = source_model.load_source_model(run_dir, base_model=args.base_model)  # refuses other architectures
    model, tokenizer = source.model, AutoTokenizer.from_pretrained(source.tokenizer_dir)
    print(f"exporting {source.note}")
    gguf_vocab = vocab.read_vocab(tokenizer, source.tokenizer_dir, model.config.vocab_size)
    gguf_file.write_gguf(
        model.state_dict(),
        model.config,
        gguf_vocab,
        output,
        outtype=args.outtype,
        name=recipe,
        overwrite=args.overwrite,
    )
    size_mb = output.stat().st_size / 1e6
    print(f"wrote {output} ({args.outtype}, {size_mb:.1f} MB, tokenizer {gguf_vocab.model}/{gguf_vocab.pre}) "
          f"in {time.perf_counter() - started:.1f} s")  # fmt: skip

    modelfile = write_modelfile(output, tokenizer, gguf_vocab, model, args.system_prompt, run_dir)
    print(f"wrote {modelfile}; create the Ollama model with: ollama create {recipe} -f {modelfile}")

    verification, passed = "not checked (--no_verify)", True
    if args.verify:
        verification, passed = verify(output, model, tokenizer, args)
    model_card.record_export(
        run_dir,
        {
            "file": str(output),
            "outtype": args.outtype,
            "size_mb": size_mb,
            "sha256": sha256_of(output),
            "modelfile": str(modelfile),
            "verification": verification,
        },
    )
    if not passed:
        print(f"error: the GGUF does not match the Hugging Face model: {verification}; {output} is kept for inspection",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def write_modelfile(output: Path, tokenizer, gguf_vocab, model, system_prompt: str | None, run_dir: Path) -> Path:
    from ft_accum.export import ollama
    from ft_accum.training import model_card

    template, why_not, parts = ollama.ollama_template(tokenizer, strip_bos=gguf_vocab.add_bos)
    if template is None:
        print(f"warning: no Ollama TEMPLATE written: {why_not} (the Modelfile says so)")
    tail = parts.tails["assistant"] if parts else None
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    stops = ollama.stop_tokens(tokenizer, tail, eos if isinstance(eos, list) else [eos])
    if system_prompt is None:
        system_prompt = model_card.read_record(run_dir, "all_results.json").get("train_system_prompt")
    modelfile = output.with_suffix(".Modelfile")
    modelfile.write_text(ollama.modelfile_text(output.name, template, why_not, stops, system_prompt))
    return modelfile


def verify(output: Path, model, tokenizer, args) -> tuple[str, bool]:
    """The llama.cpp check where xllamacpp is installed, else transformers' round trip; (summary, passed)."""
    from ft_accum.export import llamacpp_check

    if llamacpp_check.llamacpp_available():
        result = llamacpp_check.check_in_llamacpp(
            output, model, tokenizer, outtype=args.outtype, num_tokens=args.verify_tokens
        )
        for prompt in result.prompts:
            print(f"  llama.cpp {prompt.agreed}/{prompt.positions} top-1 as HF · {prompt.prompt!r} → {prompt.text!r}")
        summary = f"llama.cpp: {result.summary}"
        print(("check passed: " if result.passed else "check FAILED: ") + summary)
        return summary, result.passed
    print(f"llama.cpp is not installed, so the GGUF was not run in it; {llamacpp_check.INSTALL_HINT}")
    round_trip = llamacpp_check.check_with_transformers(output, model, tokenizer)
    summary = (
        f"transformers round trip (not llama.cpp): max logit difference {round_trip['max_logit_difference']:.4f}, "
        f"top-1 agreement {round_trip['top1_agreement']:.3f}, tokenizer "
        + ("identical" if round_trip["same_tokens"] else "DIFFERENT")
    )
    print(summary)
    return summary, round_trip["same_tokens"] and round_trip["top1_agreement"] >= llamacpp_check.Q8_0_MIN_AGREEMENT
