"""The library's layers (docs/architecture.md): imports point down only, and there is no import cycle.

Every import counts, the ones inside functions too: a deferred import is still an arrow.
"""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ft_accum"
# A layer may import its own modules and those of the layers below it; data and models sit beside each other.
LEVELS = {"core": 0, "data": 1, "models": 1, "training": 2, "planner": 3, "export": 3, "cli": 4, "testing": 5}
BESIDE = {("data", "models"), ("models", "data")}  # forbidden both ways: neither needs the other
NOT_IN_CORE = ("accelerate", "torch.distributed")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, as dotted names (`from a import b` counts a.b when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


# The evaluate metric scripts (data/metrics/<name>/<name>.py) are loaded by path, not imported.
MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py") if p.parent.parent.name != "metrics"}
GRAPH = {name: {i for i in imports_of(path) if i in MODULES and i != name} for name, path in MODULES.items()}


def layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LEVELS else None


def test_docs_architecture_names_every_module():
    """docs/architecture.md draws the layers; a module missing from it means the page no longer matches the tree."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    drawn = set(re.findall(r"[a-z_]+", page))
    missing = sorted(name for name in MODULES if name.count(".") >= 2 and name.rsplit(".", 1)[1] not in drawn)
    assert missing == [], f"modules missing from docs/architecture.md: {missing}"


def test_every_module_sits_in_a_layer():
    loose = [name for name in MODULES if name != "ft_accum" and layer(name) is None]
    assert loose == [], f"modules outside the layer packages {sorted(LEVELS)}: {loose}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if layer(n)))
def test_imports_point_down(name):
    mine = layer(name)
    for target in sorted(GRAPH[name]):
        theirs = layer(target)
        if theirs is None or theirs == mine:
            continue
        assert (mine, theirs) not in BESIDE and LEVELS[theirs] <= LEVELS[mine], (
            f"{name} ({mine}) imports {target} ({theirs}): an arrow that points up or sideways"
        )


@pytest.mark.parametrize("name", sorted(n for n in MODULES if layer(n) == "core"))
def test_the_core_has_no_accelerate_or_torch_distributed(name):
    bad = [i for i in imports_of(MODULES[name]) if i.startswith(NOT_IN_CORE)]
    assert bad == [], f"{name} is accumulation math and must not import {bad}"


def test_no_import_cycle():
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])
    assert cycles == [], "import cycles: " + "; ".join(" → ".join(c) for c in cycles)


def test_the_check_would_see_a_cycle():
    """The cycle search on a graph that has one (a → b → c → a): the test above can fail."""
    global GRAPH
    saved, GRAPH = GRAPH, {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    try:
        with pytest.raises(AssertionError, match="a → b → c → a"):
            test_no_import_cycle()
    finally:
        GRAPH = saved


ARGUMENT_READERS = {"ft_accum.training.arguments", "ft_accum.training.run_setup"}  # and the recipes


@pytest.mark.parametrize(
    "name", sorted(n for n in MODULES if layer(n) not in ("cli", "testing") and n not in ARGUMENT_READERS)
)
def test_only_the_setup_module_reads_the_argument_dataclasses(name):
    """Library functions take the values they use (a BatchPlan, a path, a LoraSettings), not `args` or `task`."""
    reads = sorted(
        f"{node.value.id}.{node.attr}"
        for node in ast.walk(ast.parse(MODULES[name].read_text()))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in ("args", "task", "task_args")
    )
    assert reads == [], f"{name} reads the argument dataclasses: {reads}"


RECIPES = sorted((PACKAGE.parent / "recipes").glob("*.py"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_reads_as_a_template(recipe):
    """STYLE.md's limits for a recipe: at most 350 lines, a `train()` of at most 100, and at most 20
    names imported from ft_accum (a template that leans on more has hidden its loop in the library),
    met without `# fmt: skip`; and the loop, from `for window in ...` to the end of the update's
    logging, short enough to see at once: at most 25 lines."""
    text = recipe.read_text()
    tree = ast.parse(text)
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    imported = [
        alias.name
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
        if (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0] == "ft_accum"
    ]
    assert len(text.splitlines()) <= 350
    assert train.end_lineno - train.lineno + 1 <= 100
    assert len(imported) <= 20, imported
    assert "fmt: skip" not in text
    loops = [n for n in ast.walk(train) if isinstance(n, ast.For) and getattr(n.target, "id", None) == "window"]
    assert len(loops) == 1, "train() has one `for window in ...` loop"
    assert loops[0].end_lineno - loops[0].lineno + 1 <= 25
