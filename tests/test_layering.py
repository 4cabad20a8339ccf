"""The package's layering, read from the imports with `ast` (docs/architecture.md).

Each layer imports only from the layers below it (lowest first):

    config      dataclass configs and ConfigError; torch-free, imports nothing of threefold's
    util        threefold.safe_loading (loading files without running their code),
                threefold.written_aside (replacing files whole or not at all)
    parallel    process groups (the ParallelContext), TP/SP layers, PP schedules, DP gradients
    kernels     attention, norms, fused cross-entropy, chosen at start-up
    model       the GPT model, its layer spec and its loss
    data        tokenizers, datasets, samplers
    checkpoint  saving, loading, resharding, Hugging Face conversion (on components)
    training    the trainer and the components it composes, observability
    entry       threefold.arguments/validation/inference/megatron_compat, the scripts, tools/

and only threefold/parallel/ reads the process groups from `threefold.parallel.state`:
everything else receives a ParallelContext. No two modules import each other (directly
or around a cycle) at import time.
"""

from __future__ import annotations

import ast
import os
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = [
    "config",
    "util",
    "parallel",
    "kernels",
    "model",
    "data",
    "checkpoint",
    "training",
    "entry",
]
_UTIL = {"threefold.safe_loading", "threefold.written_aside"}
# What outside threefold/parallel/ may call on threefold.parallel.state: set-up and tear-down,
# and building the context. The group/rank getters are parallel/'s own.
_STATE_ALLOWED = {
    "initialize_from_config",
    "initialize_for_inference",
    "initialize_distributed",
    "initialize_model_parallel",
    "destroy_model_parallel",
    "shut_down",
    "parallel_context",
    "default_backend",
    "is_initialized",
}


def layer_of(module: str) -> str | None:
    """The layer of a threefold module (dotted name), None for anything outside threefold."""
    if module in _UTIL:
        return "util"
    parts = module.split(".")
    if parts[0] != "threefold":
        return "entry" if parts[0] in ("pretrain_gpt", "finetune", "tools") else None
    if len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return "entry"  # threefold.arguments, .validation, .inference, .megatron_compat


def _module_name(path: str) -> str:
    relative = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return relative.removesuffix(".__init__")


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """(line, module) of every threefold import, including those inside functions."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative: resolve against the importing package
                base = ".".join(module.split(".")[: -node.level] + [node.module])
            found.append((node.lineno, base))
    return [(line, name) for line, name in found if name.split(".")[0] == "threefold"]


def state_getter_calls(source: str) -> list[tuple[int, str]]:
    """Calls `state.<name>(...)` on the module imported as `from threefold.parallel import
    state` (or `threefold.parallel.state.<name>`) that are not set-up/tear-down."""
    tree = ast.parse(source)
    if (
        not any(
            isinstance(node, ast.ImportFrom)
            and node.module == "threefold.parallel"
            and any(alias.name == "state" for alias in node.names)
            for node in ast.walk(tree)
        )
        and "threefold.parallel.state" not in source
    ):
        return []
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = ast.unparse(node.func.value)
            if (
                target in ("state", "threefold.parallel.state")
                and node.func.attr not in _STATE_ALLOWED
            ):
                calls.append((node.lineno, f"{target}.{node.func.attr}"))
    return calls


def violations(path: str, source: str) -> list[str]:
    module = _module_name(path)
    layer = layer_of(module)
    problems = []
    for line, name in imported_modules(source, module):
        target = layer_of(name)
        if target is None or layer is None:
            continue
        if LAYERS.index(target) > LAYERS.index(layer):
            problems.append(f"{path}:{line}: {layer} imports {name} ({target}, a layer above)")
    if not module.startswith("threefold.parallel"):
        problems += [
            f"{path}:{line}: {call}() outside threefold/parallel/; pass a ParallelContext"
            for line, call in state_getter_calls(source)
        ]
    return problems


def _sources() -> list[str]:
    paths = [os.path.join(ROOT, name) for name in ("pretrain_gpt.py", "finetune.py")]
    for top in ("threefold", "tools"):
        for directory, _, files in os.walk(os.path.join(ROOT, top)):
            paths += [os.path.join(directory, f) for f in files if f.endswith(".py")]
    return sorted(paths)


def test_no_module_imports_upward_or_reads_global_groups():
    problems = []
    for path in _sources():
        with open(path) as f:
            problems += violations(os.path.relpath(path, ROOT), f.read())
    assert not problems, "\n".join(problems)


def test_every_module_has_a_layer():
    unknown = [path for path in _sources() if layer_of(_module_name(path)) is None]
    assert not unknown


def test_a_planted_upward_import_and_a_global_getter_are_caught():
    planted = textwrap.dedent("""
        from threefold.config import Config
        from threefold.training.trainer import Trainer
        from threefold.parallel import state

        def f():
            from threefold.checkpoint.load import load_checkpoint
            return state.tensor_model_parallel_rank(), state.parallel_context()
        """)
    problems = violations("threefold/model/planted.py", planted)
    assert len(problems) == 3, problems
    assert "model imports threefold.training.trainer (training" in problems[0]
    assert "model imports threefold.checkpoint.load" in problems[1]
    assert "state.tensor_model_parallel_rank() outside threefold/parallel/" in problems[2]
    # Downward and sideways imports are fine; so is building the context.
    assert (
        violations(
            "threefold/training/fine.py",
            "from threefold.model import GPTModel\n"
            "from threefold.training.build import build_model_chunks\n",
        )
        == []
    )
    assert violations("threefold/config/leaf.py", "from threefold.parallel import state\n")


def _module_level_imports(path: str) -> set[str]:
    """The threefold modules a module imports when it is imported (not inside functions)."""
    with open(path) as f:
        tree = ast.parse(f.read())
    found = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.startswith("threefold.")}


def test_no_import_cycles():
    modules = {_module_name(p): p for p in _sources() if _module_name(p).startswith("threefold")}
    graph = {
        name: {m for m in _module_level_imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }
    state: dict[str, str] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = "open"
        for target in sorted(graph[name]):
            if state.get(target) == "open":
                cycle = trail[trail.index(target) :] + [target] if target in trail else [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, trail + [target])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
