"""--torch_compile (issue 16): regional compilation trains like eager mode, keeps the parameter names
(checkpoints and final/ unchanged), and says so in the banner. Inductor needs a C++ compiler on CPU."""

import shutil

import pytest
from conftest import run_in_process, tiny_lm_args

from ft_accum.testing import final_weights, relative_error


@pytest.mark.launch  # compiling takes ~40 s on 2 cores
@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor needs a C++ compiler"
)
def test_torch_compile_trains_like_eager(tmp_path, tiny_llama_dir, lm_data_files, capsys):
    common = {"per_device_train_batch_size": 4, "max_train_steps": 3, "packing": True}
    run_in_process("causal_lm", tiny_lm_args(tiny_llama_dir, lm_data_files, tmp_path / "eager", **common))
    run_in_process(
        "causal_lm", [*tiny_lm_args(tiny_llama_dir, lm_data_files, tmp_path / "compiled", **common), "--torch_compile"]
    )
    eager, compiled = final_weights(tmp_path / "eager"), final_weights(tmp_path / "compiled")
    assert compiled.keys() == eager.keys()  # no "_orig_mod." in the names
    assert relative_error(compiled, eager) <= 1e-5  # measured 6.8e-8: fused kernels, another summation order
    assert "torch.compile       on: each repeated block" in capsys.readouterr().out
