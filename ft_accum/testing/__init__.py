"""Test and benchmark helpers, as `transformers.testing_utils` holds its own: tiny models built from
configs, generated data, the recipe runners (in-process and through the real `accelerate launch`),
and the readers and distances the equivalence checks use.

Nothing here touches the network: models are initialised from configs, tokenizers are built from
vocabularies written here, and data is generated with fixed seeds. The recipes are found beside
the package (a source checkout), since `recipes/` is a folder of scripts, not a package.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import torch

from ft_accum.cli.check import final_weights  # noqa: F401  (re-exported for tests, benchmarks)
from ft_accum.training.run_setup import reset_accelerate_state  # noqa: F401  (re-exported for tests, benchmarks)

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
CPU_CONFIG = ROOT / "accelerate_configs" / "cpu.yaml"
# The test hooks every launched process imports at start-up (tests/fault_hooks/sitecustomize.py).
FAULT_HOOKS = ROOT / "tests" / "fault_hooks"


TOPICS = {
    "sport": "match goal team coach league score player season win cup".split(),
    "money": "bank market shares profit price trade economy rate growth fund".split(),
    "tech": "software phone chip computer network data code internet device screen".split(),
}
COMMON = "the a of and to in on said new year people last first".split()


def make_rows(n: int, seed: int) -> list[dict]:
    """Sentences of 4 to 30 words, so micro-batches pad to different lengths."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = list(TOPICS)[i % len(TOPICS)]
        words = [rng.choice(TOPICS[label] if rng.random() < 0.5 else COMMON) for _ in range(rng.randint(4, 30))]
        rows.append({"text": " ".join(words), "label": label})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_tiny_bert(path: Path) -> Path:
    """A 2-layer, 32-wide BERT classifier with dropout 0, saved like a hub checkpoint."""
    from transformers import BertForSequenceClassification

    return save_tiny_bert(path, BertForSequenceClassification, num_labels=len(TOPICS))


def make_tiny_tagger(path: Path) -> Path:
    """A 2-layer, 32-wide BERT token classifier (3 labels, dropout 0) whose vocabulary has "##s", so
    that plural words split into two sub-tokens."""
    from transformers import BertForTokenClassification

    return save_tiny_bert(path, BertForTokenClassification, num_labels=3, extra_tokens=["##s"])


def save_tiny_bert(path: Path, model_class, num_labels: int, extra_tokens: list[str] | None = None) -> Path:
    """A 2-layer, 32-wide BERT `model_class` (dropout 0) and its word-level tokenizer over TOPICS and COMMON."""
    from transformers import BertConfig, BertTokenizerFast

    Path(path).mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(extra_tokens or [])] + sorted(
        {w for ws in TOPICS.values() for w in ws} | set(COMMON)
    )
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    # transformers 5 takes the vocabulary as a dict and silently ignores vocab_file (every word
    # would become [UNK]); transformers 4 needs vocab_file. The length check catches either going wrong.
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)})
    if len(tokenizer) != len(vocab):
        tokenizer = BertTokenizerFast(vocab_file=str(path / "vocab.txt"))
    assert len(tokenizer) == len(vocab) and tokenizer.unk_token_id not in tokenizer("the match")["input_ids"]
    if extra_tokens:
        assert tokenizer.tokenize("goals") == ["goal", "##s"]
    tokenizer.save_pretrained(path)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=num_labels,
    )
    torch.manual_seed(0)
    model_class(config).save_pretrained(path)
    return path


def make_tagged_rows(n: int, seed: int) -> list[dict]:
    """Sentences of 3 to 30 words, about half tagged B-SPORT or B-MONEY, some plural (two sub-tokens)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words, tags = [], []
        for _ in range(rng.randint(3, 30)):
            topic = rng.choice(["sport", "money", None, None])
            word = rng.choice(TOPICS[topic] if topic else COMMON)
            words.append(word + ("s" if rng.random() < 0.3 else ""))
            tags.append(f"B-{topic.upper()}" if topic else "O")
        rows.append({"tokens": words, "ner_tags": tags})
    return rows


def make_text_pairs(n: int, seed: int) -> list[dict]:
    """Seq2seq rows: a source of 5 to 30 words, a target of 1 to 12 of them, sorted."""
    rng = random.Random(seed)
    words = sorted({w for ws in TOPICS.values() for w in ws} | set(COMMON))
    rows = []
    for _ in range(n):
        source = [rng.choice(words) for _ in range(rng.randint(5, 30))]
        rows.append({"source": " ".join(source), "target": " ".join(sorted(source)[: rng.randint(1, 12)])})
    return rows


def make_tiny_t5(path: Path, tokenizer_dir: Path) -> Path:
    """A 1-layer, 32-wide T5 (stands for any hub T5/BART) with the tokenizer in `tokenizer_dir`."""
    from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.save_pretrained(path)
    config = T5Config(
        vocab_size=len(tokenizer),
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=1,
        num_heads=2,
        dropout_rate=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.sep_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    T5ForConditionalGeneration(config).save_pretrained(path)
    return path


def make_sentence_pairs(n: int, seed: int) -> list[dict]:
    """Pairs of 4 to 20 words: the same topic scores 5, different topics 0."""
    rng = random.Random(seed)
    topics, rows = list(TOPICS), []
    for i in range(n):
        a, b = topics[i % len(topics)], rng.choice(topics)

        def sentence(topic):
            return " ".join(
                rng.choice(TOPICS[topic] if rng.random() < 0.6 else COMMON) for _ in range(rng.randint(4, 20))
            )

        rows.append({"sentence1": sentence(a), "sentence2": sentence(b), "score": 5.0 if a == b else 0.0})
    return rows


def recipe_args(model_dir: Path, data: dict[str, Path], output_dir: Path, **settings) -> list[str]:
    """Flags for a fast, deterministic run of any recipe on a tiny model (fp32, no LR scaling, no
    tracker). `settings` add to or override these; a value of None drops the flag."""
    defaults = {
        "model_name_or_path": model_dir,
        "train_file": data["train"],
        "validation_file": data["validation"],
        "learning_rate": 1e-3,
        "lr_scaling": "none",
        "num_warmup_steps": 0,
        "weight_decay": 0.0,
        "num_train_epochs": 1,
        "output_dir": output_dir,
        "report_to": "none",
        "seed": 7,
    }
    return [f"--{k}={v}" for k, v in {**defaults, **settings}.items() if v is not None]


def tiny_args(model_dir: Path, data: dict[str, Path], output_dir: Path, **overrides) -> list[str]:
    """`recipe_args` for the classification recipes: 48 tokens per sequence."""
    return recipe_args(model_dir, data, output_dir, **{"max_seq_length": 48, **overrides})


def load_recipe(name: str):
    """Import recipes/<name>.py as a module (recipes/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_in_process(name: str, args: list[str]) -> dict:
    """Call the recipe's main(argv) here, then reset Accelerate's process-wide singletons."""
    try:
        return load_recipe(name).main(["--config=none", *args])  # see launch_command
    finally:
        reset_accelerate_state()


def free_port() -> int:
    """A free port for a launch's rendezvous, below Linux's ephemeral range (32768+), in a block of its
    own for each pytest-xdist worker. A port the OS hands out (`bind(0)`) can be handed out again to a
    test running at the same time in another worker, or taken meanwhile by a gloo connection. A
    shared port is one suspect, not a proven cause, of a DDP launch that hung once under xdist
    (docs/tests.md)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    block = 20000 + 1000 * (int(worker) % 12 if worker.isdigit() else 0)
    for port in random.sample(range(block, block + 1000), 1000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {block}–{block + 999}")


def run_with_stack_dump(cmd: list[str], env: dict, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)`, but a run that hangs past `timeout` fails
    with each of its Python processes' stacks (faulthandler on SIGABRT) instead of a bare timeout.
    The signal goes to every descendant: torchrun starts its workers in sessions of their own."""
    import psutil  # an Accelerate dependency

    process = subprocess.Popen(
        cmd, env=env | {"PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = [*psutil.Process(process.pid).children(recursive=True), psutil.Process(process.pid)]
        for member in tree:  # workers first, so their stacks print before the launcher's ends them
            with contextlib.suppress(psutil.NoSuchProcess):
                member.send_signal(signal.SIGABRT)
        try:
            stdout, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            for member in tree:
                with contextlib.suppress(psutil.NoSuchProcess):
                    member.kill()
            stdout, stderr = process.communicate()
        raise AssertionError(
            f"hung for {timeout} s: {cmd}\nstacks on SIGABRT:\n{stdout[-3000:]}\n{stderr[-20000:]}"
        ) from None
    return subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)


def launch_command(
    name: str,
    args: list[str],
    num_processes: int = 1,
    config_file: str | Path | None = None,
    launcher: str = "accelerate",
    script: list[str] | None = None,
    lowmem: bool = False,
) -> tuple[list[str], dict]:
    """The real launch command line and environment: one process with `config_file` (default: the
    CPU config), or `num_processes` CPU processes under DDP over gloo. `launcher` "accelerate" is
    `accelerate launch`; "ft-accum" is `ft-accum launch`, the same options (ft_accum/cli/launcher.py).
    `script` (a script and its arguments) replaces the recipe and `args` after the launcher's options.
    `lowmem`: the launch may import bitsandbytes and torchao, which tests/conftest.py hides from the
    processes tests launch (as an install without the [lowmem] extra has none)."""
    env = dict(os.environ)
    if lowmem:
        env["FT_ACCUM_TEST_WITHOUT_LOWMEM"] = "0"
    if launcher == "accelerate":
        prefix = [sys.executable, "-m", "accelerate.commands.launch"]
    else:
        prefix = [str(Path(sys.executable).parent / "ft-accum"), "launch"]
    if num_processes == 1:
        cmd = [*prefix, "--config_file", str(config_file or CPU_CONFIG)]
    else:
        # `--cpu --num_processes 2` silently runs one process in accelerate 1.15; this runs two
        # (torchrun, DistributedType.MULTI_CPU, gloo). The cores are shared out, not oversubscribed
        # (a thread count already set, as under the suite's xdist workers, is kept).
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // num_processes))
        env |= {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": threads}
        cmd = [
            *prefix,
            "--multi_gpu",
            "--num_processes",
            str(num_processes),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
        ]
    # --config none first: tests set what they rely on, not the recipe's shipped config (a later --config wins).
    return [*cmd, *(script or [str(RECIPES / f"{name}.py"), "--config=none", *args])], env


def launch(
    name: str,
    args: list[str],
    num_processes: int = 1,
    check: bool = True,
    script: list[str] | None = None,
    timeout: float = 300,
    lowmem: bool = False,
) -> subprocess.CompletedProcess:
    cmd, env = launch_command(name, args, num_processes, script=script, lowmem=lowmem)
    result = run_with_stack_dump(cmd, env, timeout=timeout, cwd=ROOT)
    if check and result.returncode != 0:
        raise AssertionError(f"launch failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def runs_script(runs: list[tuple[str, list[str]]], work_dir: Path, exits: Path | None = None) -> list[str]:
    """What a launch runs in place of a recipe to run each (recipe name, arguments) of `runs`, one
    after another in the same processes (ft_accum/testing/recipe_runs.py). With `exits`, a run that
    ends in an error does not end the launch: each run's exit is written there. Each run starts from
    --config=none; arguments that give `--config recipes/configs/<name>.yaml` run the shipped config."""
    runs_file = Path(work_dir) / "runs.json"
    runs_file.write_text(json.dumps([[name, ["--config=none", *args]] for name, args in runs]))
    return [str(Path(__file__).with_name("recipe_runs.py")), str(runs_file), *([str(exits)] if exits else [])]


def launch_runs(
    name: str, runs: list[list[str]], num_processes: int, work_dir: Path, lowmem: bool = False
) -> subprocess.CompletedProcess:
    """Several runs of one recipe in one real launch (`runs_script`): each process imports everything
    once instead of once per run. Fails, with the output, if any run fails."""
    script = runs_script([(name, args) for args in runs], work_dir)
    return launch(name, [], num_processes, script=script, timeout=300 * len(runs), lowmem=lowmem)


def relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """‖a − b‖ / ‖b‖ over all parameters together."""
    assert a.keys() == b.keys()
    diff = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    norm = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (diff / norm) ** 0.5


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]


def make_documents(n: int, seed: int, min_words: int = 4, max_words: int = 40) -> list[dict]:
    """Documents of very different lengths, so padded micro-batches hold different token counts."""
    rng = random.Random(seed)
    words = COMMON + [w for ws in TOPICS.values() for w in ws]
    return [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(min_words, max_words)))} for _ in range(n)]


def make_conversations(n: int, seed: int) -> list[dict]:
    """Chats whose answers differ 10× and more in length: one-word answers, 20–40-word answers, and
    some two-round conversations (two assistant turns), as `messages` rows."""
    rng = random.Random(seed)
    words = COMMON + [w for ws in TOPICS.values() for w in ws]

    def say(low, high):
        return " ".join(rng.choice(words) for _ in range(rng.randint(low, high)))

    rows = []
    for i in range(n):
        answer = rng.choice(list(TOPICS)) if i % 2 == 0 else say(20, 40)
        messages = [{"role": "user", "content": say(3, 12)}, {"role": "assistant", "content": answer}]
        if i % 3 == 0:
            messages += [{"role": "user", "content": say(2, 6)}, {"role": "assistant", "content": say(1, 3)}]
        rows.append({"messages": messages})
    return rows


def make_preference_pairs(n: int, seed: int) -> list[dict]:
    """(prompt, chosen, rejected) rows in TRL's format whose responses differ 5× and more in length:
    a one-word answer against 20–40 words, in both orders, some prompts as two-turn conversations."""
    rng = random.Random(seed)
    words = COMMON + [w for ws in TOPICS.values() for w in ws]

    def say(low, high):
        return " ".join(rng.choice(words) for _ in range(rng.randint(low, high)))

    rows = []
    for i in range(n):
        short, long = rng.choice(list(TOPICS)), say(20, 40)
        chosen, rejected = (short, long) if i % 2 == 0 else (long, short)
        prompt = say(3, 12)
        if i % 3 == 0:  # TRL's conversational format: lists of turns
            prompt = [{"role": "user", "content": prompt}, {"role": "assistant", "content": say(1, 3)},
                      {"role": "user", "content": say(2, 6)}]  # fmt: skip
            chosen, rejected = [{"role": "assistant", "content": chosen}], [{"role": "assistant", "content": rejected}]
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


def preference_args(model_dir, files, output_dir, loss, use_lora, micro, accumulation, *extra) -> list[str]:
    """preference_tuning's flags for an exactness test: SGD without clipping, warm-up, decay or LR
    scaling, so an update is linear in its gradient and a wrong normaliser shows at its full size."""
    return [
        f"--model_name_or_path={model_dir}", f"--train_file={files['train']}",
        f"--validation_file={files['validation']}", f"--output_dir={output_dir}", f"--loss={loss}",
        f"--per_device_train_batch_size={micro}", f"--gradient_accumulation_steps={accumulation}",
        "--optim=sgd", "--learning_rate=0.5", "--max_grad_norm=0", "--num_warmup_steps=0", "--weight_decay=0",
        "--lr_scaling=none", "--num_train_epochs=1", "--max_seq_length=96", "--seed=3", "--report_to=none",
        *(["--use_lora", "--lora_r=4"] if use_lora else []), *extra,
    ]  # fmt: skip


@contextlib.contextmanager
def counting_causal_lms():
    """Inside the block, record each causal LM built (`PreTrainedModel.__init__`) and each one copied
    (`copy.deepcopy`), by class name: {"built": [...], "copied": [...]}. A run that says it keeps one
    model in memory must build one and copy none."""
    import copy
    from unittest import mock

    from transformers import PreTrainedModel

    seen = {"built": [], "copied": []}
    init, deepcopy = PreTrainedModel.__init__, copy.deepcopy

    def counted_init(self, *args, **kwargs):
        if type(self).__name__.endswith("ForCausalLM"):
            seen["built"].append(type(self).__name__)
        init(self, *args, **kwargs)

    def counted_deepcopy(x, *args):
        if type(x).__name__.endswith("ForCausalLM"):
            seen["copied"].append(type(x).__name__)
        return deepcopy(x, *args)

    with (
        mock.patch.object(PreTrainedModel, "__init__", counted_init),
        mock.patch.object(copy, "deepcopy", counted_deepcopy),
    ):
        yield seen


def make_tiny_chat_lm(path: Path, width: int = 32, tokenizer_dir: Path | None = None, eos_scale: float = 1.0) -> Path:
    """A 2-layer, `width`-wide Llama with SmolLM2-135M-Instruct's real tokenizer and chat template (bundled,
    offline), or the tokenizer in `tokenizer_dir`. `eos_scale` multiplies the output layer's EOS row:
    at 60 its logit is large one way or the other, so sampled completions stop early at some
    positions and run to the length limit at others (the GRPO tests' unequal lengths)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from ft_accum.data.offline_assets import bundled_smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or bundled_smollm2_dir())
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=512, attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] *= eos_scale
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def varied_reward(prompts, completions, **columns) -> list[float]:
    """A reward for the GRPO tests that differs between completions of one prompt: a function of the
    completion's text only (its length and letters), so equal completions score equally."""
    texts = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions]
    return [(len(t) % 7) / 6 + 0.5 * sum(ch in "aeiou" for ch in t) / max(len(t), 1) for t in texts]


def build_word_tokenizer(path: Path):
    """A word-level fast tokenizer with real pad and eos tokens, saved like a hub tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = ["<pad>", "<unk>", "<eos>"] + sorted({w for ws in TOPICS.values() for w in ws} | set(COMMON))
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    tokenizer.save_pretrained(path)
    return tokenizer


def make_tiny_lm(arch: str, path: Path, width: int = 32, intermediate_size: int | None = None) -> Path:
    """A 2-layer, `width`-wide causal LM from a config (dropout 0, 64 positions), saved with its tokenizer.
    A Llama's MLP is `intermediate_size` wide (2 × `width` unless given).

    bitsandbytes' CPU 4-bit kernels need layers at least 64 wide (one quantization block)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    tokenizer = build_word_tokenizer(path)
    common = {
        "vocab_size": len(tokenizer),
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.eos_token_id,
    }
    if arch == "gpt2":
        config = GPT2Config(
            n_embd=width,
            n_layer=2,
            n_head=2,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
        model_class = GPT2LMHeadModel
    else:
        config = LlamaConfig(
            hidden_size=width,
            intermediate_size=intermediate_size or 2 * width,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=64,
            attention_dropout=0.0,
            **common,
        )
        model_class = LlamaForCausalLM
    torch.manual_seed(0)
    model_class(config).save_pretrained(path)
    return path


def tiny_lm_args(model_dir: Path, data: dict[str, Path], output_dir: Path, **overrides) -> list[str]:
    """`recipe_args` for causal_lm: blocks of 48 tokens."""
    return recipe_args(model_dir, data, output_dir, **{"block_size": 48, **overrides})


def snapshot(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path: what 'nothing was damaged' compares."""
    from ft_accum.core.integrity import sha256_of

    return {str(p.relative_to(folder)): sha256_of(p) for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def copy_checkpoint(run_dir: Path, step: int, new_output_dir: Path) -> Path:
    """A fresh --output_dir holding only `run_dir`'s checkpoint at `step`: what a crash right after it leaves to resume from."""
    name = f"step_{step:06d}"
    (new_output_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / name, new_output_dir / "checkpoints" / name)
    return new_output_dir


def load_script(path: str | Path, name: str | None = None):
    """Import a script (a recipe or a benchmark) as a module by its path, without touching sys.path."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


GO_TEMPLATE_RENDERER = r"""package main

import (
	"encoding/json"
	"os"
	"text/template"
)

// Ollama's chat data: template.Execute passes {"System", "Messages"} with messages of Role and Content.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

func main() {
	var input struct {
		Template string     `json:"template"`
		System   string     `json:"system"`
		Messages []*Message `json:"messages"`
	}
	if err := json.NewDecoder(os.Stdin).Decode(&input); err != nil {
		panic(err)
	}
	t := template.Must(template.New("").Parse(input.Template))
	if err := t.Execute(os.Stdout, map[string]any{"System": input.System, "Messages": input.Messages}); err != nil {
		panic(err)
	}
}
"""


def render_with_go(template: str, messages: list[dict], system: str, work_dir: Path) -> str:
    """Render an Ollama TEMPLATE with Go's own text/template (what Ollama runs), on messages already
    collated as Ollama collates them; needs the `go` toolchain (Debian's golang-go)."""
    source = Path(work_dir) / "render.go"
    source.write_text(GO_TEMPLATE_RENDERER)
    payload = json.dumps({"template": template, "system": system, "messages": messages})
    env = {**os.environ, "GOCACHE": str(Path(work_dir) / "gocache"), "GO111MODULE": "off"}
    done = subprocess.run(
        ["go", "run", str(source)], input=payload, capture_output=True, text=True, env=env, timeout=300
    )
    if done.returncode:
        raise RuntimeError(f"go run failed: {done.stderr}")
    return done.stdout


def make_sentencepiece_llama(path: Path, vocab_size: int = 1200) -> Path:
    """A 2-layer, 64-wide Llama with a tokenizer shaped as TinyLlama's and Llama 2's: a SentencePiece
    model converted to tokenizer.json (BPE over '▁' pieces with byte fallback, <0x00>..<0xFF> after
    <unk> <s> </s>, BOS added), trained here on 300 bundled BBC articles; weights at init std 0.1."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from ft_accum.data.offline_assets import load_bbc_news

    texts = [row["text"] for row in load_bbc_news()["train"].select(range(300))]
    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = pre_tokenizers.Split(
        "▁", behavior="merged_with_next"
    )  # training only: no merge across words
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256))]
    backend.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, limit_alphabet=80)
    )
    backend.pre_tokenizer = None
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, initializer_range=0.1, bos_token_id=1, eos_token_id=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path
