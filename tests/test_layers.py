"""The layering contract, read from the source: every import of every module (module level, inside functions,
under TYPE_CHECKING: all of them) runs to the module's own floor or below, and no modules import each other in
a circle.

The floors, top to bottom (a module's floor is that of its longest matching prefix in LAYERS; a new module
must be placed there, or this test fails naming it):

    top      the user-facing entries: the CLI, the OpenAI server (the API process), the offline LLM, the
             bench commands
    engine   requests → steps: the engine core (scheduler, block manager, batching), its process and the
             front end's output processing
    runner   a step's batch on the device, in four rooms, top down:
               parallel  tensor parallelism: the group of ranks, its workers, the process group
               runner    ModelRunner (the step path's top) and RunnerInfo, what the engine core reads of it
               startup   start-up: model load, memory plan, probes, graph planning and capture, the self-check,
                         the timing loop
               step      a step's pieces: typed inputs, the graph table (dispatch), CUDA graphs, forwards, sampler
    model    the Llama family, its layers, the TP communicator, the weight loaders, the runner↔model
             contract (model.attention_metadata)
    kernels  Triton kernels and their PyTorch references; they take tensors or duck-typed objects
             (kernels.metadata.AttentionInputs) and import nothing from above
    ground   what every floor may read: config (constants, EngineConfig; graph_sizes, its graph-size settings),
             sampling (SamplingParams),
             model_files (HF config / tokenizer / EOS / GGUF metadata), model_spec (a config's shape and family),
             rope_config (its RoPE settings),
             checkpoint_formats, errors, hub, tiny, the package root

The package root's lazy attributes (`from nanoserve import LLM`, PEP 562 through importlib) are the public
entry, not an import: the contract does not count them.

One rule beyond the floors, from the wire's "every message in one module": msgspec.Struct classes (what the
engine core process and its clients send) are defined in engine/messages.py only.
"""
from __future__ import annotations

import ast
from pathlib import Path

import nanoserve

PACKAGE = Path(nanoserve.__file__).parent

LAYERS = [  # top first
    ("top", ("nanoserve.cli", "nanoserve.__main__", "nanoserve.server", "nanoserve.llm", "nanoserve.bench")),
    ("engine", ("nanoserve.engine",)),
    ("runner.parallel", ("nanoserve.runner.parallel",)),
    ("runner", ("nanoserve.runner.model_runner", "nanoserve.runner.info")),
    ("runner.startup", ("nanoserve.runner.startup",)),
    ("runner.step", ("nanoserve.runner",)),
    ("model", ("nanoserve.model",)),
    ("kernels", ("nanoserve.kernels",)),
    ("ground", ("nanoserve", "nanoserve.config", "nanoserve.sampling", "nanoserve.model_files", "nanoserve.rope_config",
                "nanoserve.model_spec", "nanoserve.hub", "nanoserve.tiny", "nanoserve.errors", "nanoserve.checkpoint_formats",
                "nanoserve.graph_sizes")),
]
WIRE_MODULE = "nanoserve.engine.messages"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imported(module: str, path: Path) -> set[str]:
    """The nanoserve modules `module` imports anywhere in its source (a `from pkg import name` of a submodule
    counts as that submodule)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: None if is_package else -1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            while name not in MODULES and "." in name:  # `import nanoserve.x.y as z`, `from m import function`
                name = name.rsplit(".", 1)[0]
            if name in MODULES and name != module:
                found.add(name)
    return found


GRAPH = {m: _imported(m, p) for m, p in MODULES.items()}


def _layer(module: str) -> int:
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{module} is on no floor: add it to LAYERS in {__file__}"
    return rank


def test_every_module_is_on_a_floor():
    for module in MODULES:
        _layer(module)


def test_no_import_runs_up():
    upward = [f"{m} ({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0]})"
              for m, targets in sorted(GRAPH.items()) for t in sorted(targets) if _layer(t) < _layer(m)]
    assert not upward, "imports that run up a floor:\n" + "\n".join(upward)


def test_no_module_imports_one_that_imports_it_back():
    pairs = sorted({tuple(sorted((m, t))) for m, targets in GRAPH.items() for t in targets if m in GRAPH[t]})
    assert not pairs, f"modules that import each other: {pairs}"


def test_no_import_circles():
    circles = [c for c in _strongly_connected(GRAPH) if len(c) > 1]
    assert not circles, "import circles: " + "; ".join(" → ".join(sorted(c)) for c in circles)


def test_wire_messages_live_in_one_module():
    defined = {m for m, p in MODULES.items() if _defines_struct(p)}
    assert defined == {WIRE_MODULE}, f"msgspec.Struct classes outside {WIRE_MODULE}: {sorted(defined - {WIRE_MODULE})}"


def test_the_contract_sees_real_edges():
    """The parser must see what the code does: a function-level import, a relative import, a submodule import."""
    assert "nanoserve.engine.core" in GRAPH["nanoserve.engine.core_process"]
    assert "nanoserve.model.attention_metadata" in GRAPH["nanoserve.runner.forward"]
    assert GRAPH["nanoserve.model_files"] <= {"nanoserve.config", "nanoserve.errors", "nanoserve.checkpoint_formats",
                                             "nanoserve.rope_config", "nanoserve.model_spec"}


def _defines_struct(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                if ast.unparse(base) in ("msgspec.Struct", "Struct"):
                    return True
    return False


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components (iterative: no recursion limit on a long chain)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.add(top)
                        if top == node:
                            break
                    out.append(component)
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def test_the_runner_model_contract_gives_the_kernels_what_they_read():
    """kernels.metadata.AttentionInputs (what attention reads) ⊆ model.attention_metadata.AttentionMetadata."""
    import dataclasses

    from nanoserve.kernels.metadata import AttentionInputs
    from nanoserve.model.attention_metadata import AttentionMetadata

    read = set(AttentionInputs.__annotations__) | {"num_seqs"}
    given = {f.name for f in dataclasses.fields(AttentionMetadata)} | {"num_seqs"}
    assert read <= given, f"the kernels read {sorted(read - given)}, which AttentionMetadata lacks"
    assert isinstance(AttentionMetadata.num_seqs, property)


MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60  # outside kernels/, whose Triton kernels are long by nature


def test_modules_and_functions_stay_small():
    """Readable rooms: no module outside kernels/ over MAX_MODULE_LINES lines, no function over MAX_FUNCTION_LINES."""
    too_long = []
    for module, path in sorted(MODULES.items()):
        if module.startswith("nanoserve.kernels"):
            continue
        source = path.read_text()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{module}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{module}.{node.name}: {lines} lines")
    assert not too_long, "too long:\n" + "\n".join(too_long)
