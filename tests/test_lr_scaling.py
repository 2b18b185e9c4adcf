import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ft_accum.core.errors import ConfigError
from ft_accum.core.lr_scaling import describe_lr_scaling, resolve_lr_policy, scale_learning_rate

splits = st.tuples(st.integers(1, 32), st.integers(1, 32), st.integers(1, 8))


@given(
    a=splits,
    b=splits,
    policy=st.sampled_from(["none", "linear", "sqrt", "auto"]),
    optim=st.sampled_from(["adamw_torch", "sgd"]),
    base=st.integers(1, 512),
)
def test_lr_depends_on_the_effective_batch_only(a, b, policy, optim, base):
    """Any two splits of the same effective batch get the same LR."""
    effective = a[0] * a[1] * a[2]
    other = (b[0], b[1], effective // (b[0] * b[1])) if effective % (b[0] * b[1]) == 0 else a
    assert other[0] * other[1] * other[2] == effective
    assert scale_learning_rate(1e-3, effective, base, policy, optim) == scale_learning_rate(
        1e-3, other[0] * other[1] * other[2], base, policy, optim
    )


@given(effective=st.integers(1, 4096), base=st.integers(1, 4096), lr=st.floats(1e-6, 1.0))
def test_linear_and_sqrt_formulas(effective, base, lr):
    assert scale_learning_rate(lr, effective, base, "linear") == pytest.approx(lr * effective / base)
    assert scale_learning_rate(lr, effective, base, "sqrt") == pytest.approx(lr * math.sqrt(effective / base))
    assert scale_learning_rate(lr, effective, base, "none") == lr
    assert scale_learning_rate(lr, base, base, "linear") == pytest.approx(lr)


@pytest.mark.parametrize(
    "optim, rule", [("adamw_torch", "sqrt"), ("adam", "sqrt"), ("AdamW8bit", "sqrt"), ("sgd", "linear")]
)
def test_auto_picks_sqrt_for_adam_and_linear_for_sgd(optim, rule):
    assert resolve_lr_policy("auto", optim) == rule
    expected = {"sqrt": 2e-3, "linear": 4e-3}[rule]
    assert scale_learning_rate(1e-3, 128, 32, "auto", optim) == pytest.approx(expected)


def test_no_base_batch_means_no_scaling_and_the_banner_says_so():
    assert scale_learning_rate(3e-4, 512, None, "linear") == 3e-4
    assert "not scaled" in describe_lr_scaling(3e-4, 3e-4, 512, None, "linear", "sgd")


def test_unknown_policy_and_optimizer_are_errors():
    with pytest.raises(ConfigError, match="must be one of"):
        scale_learning_rate(1e-3, 64, 32, "cubic")
    with pytest.raises(ConfigError, match="choose --lr_scaling linear or sqrt"):
        resolve_lr_policy("auto", "adafactor")
