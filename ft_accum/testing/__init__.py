"""Test and benchmark helpers, as `transformers.testing_utils` holds its own, in modules named after
what they hold: `tiny_models`, `generated_data`, `recipe_launch` (the recipe runners),
`comparisons` (readers and distances), `go_templates`, `benchmarking`, `recipe_runs`.

Nothing here touches the network: models are initialised from configs, tokenizers are built from
vocabularies written here, and data is generated with fixed seeds. The names are re-exported here
so that tests and benchmarks can keep `from ft_accum.testing import ...`.
"""

from ft_accum.cli.check import final_weights  # noqa: F401  (re-exported for tests, benchmarks)
from ft_accum.testing.comparisons import *  # noqa: F401,F403
from ft_accum.testing.generated_data import *  # noqa: F401,F403
from ft_accum.testing.go_templates import *  # noqa: F401,F403
from ft_accum.testing.recipe_launch import *  # noqa: F401,F403
from ft_accum.testing.tiny_models import *  # noqa: F401,F403
from ft_accum.training.run_setup import reset_accelerate_state  # noqa: F401  (re-exported for tests, benchmarks)
