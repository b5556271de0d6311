"""The house rules of the import graph: no cycles between modules, no lower layer importing a higher one.

The graph is built from the source (AST), not by importing anything, so it sees every import: at module
level, inside functions (lazy imports), under `if TYPE_CHECKING:`, and `importlib.import_module` with a
literal name. Nodes are modules; a package's `__init__.py` is the node named after the package.

Edges, precisely:
- `import a.b.c` -> a.b.c; `from a.b import c` -> a.b.c when c is a module, else a.b (the package's
  `__init__`, where the name c is defined); relative imports are resolved first.
- Importing a submodule also runs its parent packages' `__init__`, but that is NOT an edge: otherwise every
  package whose `__init__` re-exports its submodules would be a cycle. A package's `__init__` is an edge
  target only when names are taken from it (`from rapidserve.loader import ModelSource`).
- A package `__init__` that resolves names lazily through a module-level `_LAZY = {name: module}` table
  (the root `rapidserve`: `rapidserve.LLM`): `from rapidserve import LLM` is an import of `rapidserve.llm`,
  charged to the module that asks; the table is not an import of the `__init__` itself. `__version__`,
  defined in the root `__init__`, is an import of the root, which sits in the lowest rapidserve layer.

Layers (docs/architecture.md, "Layers"): `LAYERS` below, lowest first. A module may import modules of its
own layer or of lower layers; a module's layer is that of the longest entry that is it or a package
containing it, and every module must be placed (a new top-level module or package needs a row here).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("rapidserve", "hip_ext")

# Lowest first. Within a layer imports go either way (the cycle check still applies).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # The AMD stream library: imports nothing from rapidserve.
    ("hip_ext", ("hip_ext",)),
    # Plain data: the frozen config tree, per-request sampling parameters, the offline API's results.
    # Plus the package root (`__version__`; the names it resolves lazily count as imports of their modules).
    # Plus ConfigError and what the tree's modules share (`config_base`), the model, KV cache, scheduler, runner and
    # parallelism sections (`model_config`, `cache_config`, `scheduler_config`, `runner_config`, `parallel_config`;
    # `config` holds the root and re-exports them), the launch, partition and server sections
    # (`launch_config`, `partition_config`, `server_config`), the model's sampling defaults (`generation_config`), the
    # --kv-events-config section (`kv_events_config`), the quantization section (`quant_config`), the model's
    # mixture-of-experts section and its tensors' names (`moe_config`), the policies'
    # declarations and the flag check derived from them (`policy_spec`), and the tree's sections from the settings
    # with every check that needs no model (`engine_settings`). Plus what vLLM's users may ask for and rapidserve's
    # answers, shared by the CLI, the server and `LLM`: `vllm_serve_flags` (vLLM's serve flags accepted or refused),
    # `vllm_reasons` (the reasons for vLLM request fields both APIs take); the sampling parameters' parts
    # (`sampling_checks`, `structured_outputs`, `vllm_sampling_fields`). Plus the batch limits' defaults by device,
    # the seats and the decode graph buckets (`batch_limits`). Plus JSON input that refuses a key written twice
    # (`jsonfile`: standard library only; the loaders of profiles, device tables, traces, reports and JSON flags, the
    # benchmark's too, read through it). Plus keeping credentials out of what is printed, logged or written
    # (`redaction`: standard library only; the server, `rapidserve bench` and bench/ redact through it). Plus vLLM's
    # human-readable integers (`human_int`: standard library only; the CLI's flags that vLLM types so).
    ("config", ("rapidserve", "rapidserve.config_base", "rapidserve.config", "rapidserve.model_config",
                "rapidserve.cache_config", "rapidserve.scheduler_config", "rapidserve.runner_config",
                "rapidserve.parallel_config", "rapidserve.launch_config",
                "rapidserve.partition_config", "rapidserve.server_config", "rapidserve.generation_config",
                "rapidserve.kv_events_config", "rapidserve.quant_config", "rapidserve.policy_spec",
                "rapidserve.engine_settings", "rapidserve.sampling_params", "rapidserve.prompt", "rapidserve.outputs",
                "rapidserve.moe_config", "rapidserve.vllm_serve_flags", "rapidserve.vllm_reasons",
                "rapidserve.sampling_checks", "rapidserve.structured_outputs", "rapidserve.vllm_sampling_fields",
                "rapidserve.batch_limits", "rapidserve.jsonfile", "rapidserve.redaction", "rapidserve.human_int")),
    # Shared-memory rings and doorbells between processes (no torch).
    ("ipc", ("rapidserve.ipc",)),
    # The model and its memory: loading weights, kernels, the transformer, the paged KV pool.
    ("model", ("rapidserve.loader", "rapidserve.attention", "rapidserve.ops", "rapidserve.models",
               "rapidserve.kv_pool", "rapidserve.parallel")),
    # Per-request rules and state: the stop check, sampling, block tables and the prefix cache (its KV events), the
    # tokenizer.
    ("requests", ("rapidserve.stop_rules", "rapidserve.sampler", "rapidserve.logit_controls",
                  "rapidserve.block_manager", "rapidserve.kv_events", "rapidserve.tokenizer", "rapidserve.structured")),
    # Running the model on batches: the rapidserve.runner package (ModelRunner and its parts: batch inputs, decode
    # graphs, sampling, tensor-parallel hooks; block-wise prefill tasks, piecewise prefill graphs, zero-copy
    # sharing of weights + pool), building the config tree.
    ("runner", ("rapidserve.runner", "rapidserve.config_builder")),
    # Compute partitions: backends, profiles, the roofline model, the profile command.
    ("partition", ("rapidserve.partition",)),
    # Engines: the one step loop in its worker processes (workers, launcher, client) and in-process (EngineCore).
    ("engine", ("rapidserve.core", "rapidserve.engine")),
    # The offline API: `LLM` (`llm`), vLLM's LLM(...) arguments (`llm_args`), its generate/chat inputs (`llm_inputs`).
    ("llm", ("rapidserve.llm", "rapidserve.llm_args", "rapidserve.llm_inputs")),
    # The OpenAI-compatible HTTP server.
    ("server", ("rapidserve.server",)),
    # `rapidserve bench`: a load generator for any OpenAI-compatible server (imports nothing else of rapidserve but
    # `jsonfile` and `redaction`, standard library only).
    ("benchmark", ("rapidserve.benchmark",)),
    # The entry point: main and the parser (`cli`), the shared flags (`cli_args`), each command's flags and code
    # (`cli_generate`, `cli_serve`), vLLM's serve flags (`cli_vllm`; those it accepts or refuses: `vllm_serve_flags`,
    # in the config layer, where `LLM` reads them too).
    ("cli", ("rapidserve.cli", "rapidserve.cli_args", "rapidserve.cli_generate", "rapidserve.cli_serve",
             "rapidserve.cli_vllm")),
)


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    path: Path
    line: int
    statement: str

    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def module_files() -> dict[str, Path]:
    """Every module of the packages by dotted name (a package's `__init__.py` under the package's name)."""
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def lazy_tables(mods: dict[str, Path]) -> dict[str, dict[str, str]]:
    """Per package: its `__init__`'s module-level `_LAZY = {"Name": "module", ...}` table, if any."""
    tables: dict[str, dict[str, str]] = {}
    for module, path in mods.items():
        if path.name != "__init__.py":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if (isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict)
                    and any(isinstance(t, ast.Name) and t.id == "_LAZY"
                            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))):
                tables[module] = {k.value: v.value for k, v in zip(node.value.keys, node.value.values, strict=True)
                                  if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)}
    return tables


def _owner(name: str, mods: dict[str, Path]) -> str | None:
    """The module that `name` (a module, or a module's attribute) lives in, if it is one of ours."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in mods:
            return ".".join(parts)
        parts.pop()
    return None


def _imported_names(node: ast.AST, module: str, is_package: bool, mods: dict[str, Path],
                    lazy: dict[str, dict[str, str]]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            yield sub if sub in mods else lazy.get(target, {}).get(alias.name, target)
    elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
          and isinstance(node.args[0].value, str)):
        f = node.func
        if (isinstance(f, ast.Attribute) and f.attr == "import_module") or \
                (isinstance(f, ast.Name) and f.id in ("import_module", "__import__")):
            yield node.args[0].value


def import_edges() -> list[Edge]:
    """Every import of one of our modules by another, wherever the statement is."""
    mods = module_files()
    lazy = lazy_tables(mods)
    edges: list[Edge] = []
    for module, path in mods.items():
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source, filename=str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom, ast.Call)):
                continue
            for name in _imported_names(node, module, path.name == "__init__.py", mods, lazy):
                dst = _owner(name, mods)
                if dst is not None and dst != module:
                    edges.append(Edge(module, dst, path, node.lineno, lines[node.lineno - 1].strip()))
    return edges


def placement(module: str) -> tuple[int, str] | None:
    """(layer index, entry) of the longest LAYERS entry that is `module` or a package containing it."""
    best: tuple[int, str] | None = None
    for i, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and (best is None or len(entry) > len(best[1])):
                best = (i, entry)
    return best


def layer_of(module: str) -> int | None:
    where = placement(module)
    return None if where is None else where[0]


def find_cycles(edges: list[Edge]) -> list[tuple[list[str], list[Edge]]]:
    """Per strongly connected component of more than one module: its modules, and one cycle through them."""
    adj: dict[str, dict[str, Edge]] = {}
    for e in edges:
        adj.setdefault(e.src, {}).setdefault(e.dst, e)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(adj):  # Tarjan, iterative
        if root in index:
            continue
        work = [(root, iter(sorted(adj.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(adj.get(w, {})))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    components.append(sorted(comp))
    cycles = []
    for comp in components:  # shortest way back to the first module, within the component (BFS)
        members, start = set(comp), comp[0]
        prev: dict[str, Edge] = {}
        frontier = [start]
        while frontier and start not in prev:
            nxt = []
            for v in frontier:
                for w, e in sorted(adj.get(v, {}).items()):
                    if w in members and w not in prev:
                        prev[w] = e
                        nxt.append(w)
            frontier = nxt
        cycle = [prev[start]]
        while cycle[-1].src != start:
            cycle.append(prev[cycle[-1].src])
        cycles.append((comp, cycle[::-1]))
    return cycles


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_edges()


def test_the_graph_sees_every_kind_of_import(edges: list[Edge]) -> None:
    """Sanity of the tool on imports known to exist (module level, lazy, TYPE_CHECKING, re-exports) and lazy names."""
    pairs = {(e.src, e.dst) for e in edges}
    assert ("rapidserve.runner.model_runner", "rapidserve.kv_pool") in pairs  # module level
    # inside a function, and TYPE_CHECKING
    assert ("rapidserve.runner.model_runner", "rapidserve.runner.model_sharing") in pairs
    assert ("rapidserve.runner.tp", "rapidserve.runner.inputs") in pairs  # between modules inside a package
    assert ("rapidserve.runner", "rapidserve.runner.model_runner") in pairs  # the package's __init__ re-exporting
    assert ("rapidserve.loader", "rapidserve.loader.hf") in pairs  # lazy, `from pkg import module`
    assert ("rapidserve.tokenizer", "rapidserve.loader") in pairs  # a name defined by the package
    assert ("rapidserve.ipc", "rapidserve.ipc.ring") in pairs  # an __init__ re-exporting
    mods = module_files()
    lazy = lazy_tables(mods)
    assert lazy["rapidserve"]["LLM"] == "rapidserve.llm"
    stmt = ast.parse("from rapidserve import LLM, __version__").body[0]
    assert list(_imported_names(stmt, "rapidserve.ipc.ring", False, mods, lazy)) == ["rapidserve.llm", "rapidserve"]


def test_the_cycle_finder_finds_a_cycle() -> None:
    p = REPO / "x.py"
    fake = [Edge("a", "b", p, 1, ""), Edge("b", "c", p, 2, ""), Edge("c", "a", p, 3, ""), Edge("c", "d", p, 4, "")]
    ((modules, cycle),) = find_cycles(fake)
    assert modules == ["a", "b", "c"]
    assert [e.line for e in cycle] == [1, 2, 3]


def test_every_module_has_a_layer() -> None:
    """Placed by its own row, not just as part of the package root `rapidserve` (its __init__)."""
    unplaced = []
    for m in module_files():
        where = placement(m)
        if where is None or (where[1] == "rapidserve" and m != "rapidserve"):
            unplaced.append(m)
    assert not unplaced, (f"modules without a layer (add them to LAYERS in {Path(__file__).name} and to the "
                          f"Layers section of docs/architecture.md): {unplaced}")


def test_no_import_cycles(edges: list[Edge]) -> None:
    cycles = find_cycles(edges)
    msg = "\n\n".join(f"import cycle among {', '.join(modules)}, e.g.:\n"
                     + "\n".join(f"  {e.where()}: {e.src} -> {e.dst}   ({e.statement})" for e in cycle)
                     for modules, cycle in cycles)
    assert not cycles, msg


def test_no_import_from_a_higher_layer(edges: list[Edge]) -> None:
    names = [name for name, _ in LAYERS]
    bad = []
    for e in sorted(edges, key=lambda e: (str(e.path), e.line)):
        src, dst = layer_of(e.src), layer_of(e.dst)
        if src is not None and dst is not None and dst > src:
            bad.append(f"  {e.where()}: {e.src} (layer {names[src]}) imports {e.dst} (layer {names[dst]}, higher)"
                       f"   ({e.statement})")
    assert not bad, "imports from a higher layer:\n" + "\n".join(bad)
