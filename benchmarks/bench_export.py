"""python benchmarks/bench_export.py [--run_dir outputs/instruction_tuning] [--quick] [--output FILE]

`ft-accum export --format gguf` on SmolLM2-135M-Instruct (the bundled base, or a finished run's
final/ with --run_dir): the export's wall time and file size at F16 and Q8_0, llama.cpp's agreement
with the Hugging Face model (the export's own check), and generation speed on this CPU: llama.cpp
(xllamacpp) running each GGUF against transformers' `generate` on the fp32 model, on the same chat
prompts, greedy, the same number of new tokens (end-of-sequence ignored on both sides), the same
thread count. Medians of --repeats, interleaved. Needs the [export] extra.

--quick: a tiny Llama, one repeat, 8 tokens: a smoke test of this script, never a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ft_accum.cli.main import main as ft_accum  # noqa: E402
from ft_accum.export import llamacpp_check  # noqa: E402
from ft_accum.testing.benchmarking import machine_info  # noqa: E402

OUTTYPES = ("f16", "q8_0")


def llamacpp_generation_seconds(gguf: Path, prompts: list, new_tokens: int, threads: int, log: Path) -> list[float]:
    """Wall seconds of each prompt's greedy generation in llama.cpp (the model loaded once, beforehand)."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = str(gguf)
    params.n_ctx, params.n_parallel = 1024, 1
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads
    seconds = []
    with llamacpp_check.quiet_stderr(log):
        server = xllamacpp.Server(params)
        for messages in prompts:
            request = {"messages": messages, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
            started = time.perf_counter()
            reply = server.handle_chat_completions({**request, "cache_prompt": False})
            seconds.append(time.perf_counter() - started)
            assert reply["usage"]["completion_tokens"] == new_tokens, reply["usage"]
        del server
    return seconds


@torch.no_grad()
def hf_generation_seconds(model, tokenizer, prompts: list, new_tokens: int) -> list[float]:
    seconds = []
    for messages in prompts:
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        started = time.perf_counter()
        out = model.generate(
            **ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
        seconds.append(time.perf_counter() - started)
        assert out.shape[1] - ids["input_ids"].shape[1] == new_tokens
    return seconds


def model_dir_for(args, work: Path) -> Path:
    if args.quick:
        from ft_accum.testing import make_tiny_chat_lm

        return make_tiny_chat_lm(work / "tiny", width=64)
    if args.run_dir:
        return Path(args.run_dir)
    from ft_accum.data.offline_assets import bundled_smollm2_dir

    return bundled_smollm2_dir()


def measure(args) -> dict:
    from transformers import AutoTokenizer

    from ft_accum.export import source_model

    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    work = Path(tempfile.mkdtemp(prefix="bench_export_"))
    model_dir = model_dir_for(args, work)
    new_tokens = 8 if args.quick else args.new_tokens
    repeats = 1 if args.quick else args.repeats
    results = {"model": str(model_dir), "threads": threads, "new_tokens": new_tokens, "repeats": repeats, "export": {}}
    for outtype in OUTTYPES:
        times = []
        for _ in range(repeats):
            output = work / f"model-{outtype}.gguf"
            started = time.perf_counter()
            ft_accum(["export", str(model_dir), "--format", "gguf", "--outtype", outtype, "--output", str(output),
                      "--overwrite", "--no_verify"])  # fmt: skip
            times.append(time.perf_counter() - started)
        results["export"][outtype] = {"seconds": statistics.median(times), "mb": output.stat().st_size / 1e6}

    source = source_model.load_source_model(model_dir)
    model, tokenizer = source.model.eval(), AutoTokenizer.from_pretrained(source.tokenizer_dir)
    prompts = llamacpp_check.prompt_messages(tokenizer, None)
    log = work / "llamacpp.log"
    for outtype in OUTTYPES:
        check = llamacpp_check.check_in_llamacpp(work / f"model-{outtype}.gguf", model, tokenizer, outtype=outtype)
        results["export"][outtype]["check"] = check.summary
        results["export"][outtype]["check_passed"] = check.passed
    rates: dict[str, list[float]] = {"hf_fp32": [], **{f"llamacpp_{o}": [] for o in OUTTYPES}}
    for _ in range(repeats):  # interleaved: a slow moment of the machine hits every contender
        seconds = hf_generation_seconds(model, tokenizer, prompts, new_tokens)
        rates["hf_fp32"].append(len(prompts) * new_tokens / sum(seconds))
        for outtype in OUTTYPES:
            seconds = llamacpp_generation_seconds(work / f"model-{outtype}.gguf", prompts, new_tokens, threads, log)
            rates[f"llamacpp_{outtype}"].append(len(prompts) * new_tokens / sum(seconds))
    results["tokens_per_second"] = {name: statistics.median(values) for name, values in rates.items()}
    results["speedup_over_hf"] = {
        name: rate / results["tokens_per_second"]["hf_fp32"] for name, rate in results["tokens_per_second"].items()
    }
    results["machine"] = machine_info()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run_dir", default=None, help="a finished run to export (default: the bundled SmolLM2)")
    parser.add_argument("--new_tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="threads for both (default: every core)")
    parser.add_argument("--quick", action="store_true", help="a tiny Llama, once: a smoke test, never a measurement")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "export.json"))
    args = parser.parse_args(argv)
    if not llamacpp_check.llamacpp_available():
        raise SystemExit(f"error: this benchmark runs llama.cpp; {llamacpp_check.INSTALL_HINT}")
    results = measure(args)
    Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: results[k] for k in ("export", "tokens_per_second", "speedup_over_hf")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
