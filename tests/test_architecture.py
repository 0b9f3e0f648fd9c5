"""The import order of docs/architecture.md §1.2, checked on the source: every import of a
package module points to the importer's own layer or a lower one, the module graph has no
cycle, and imports of package modules sit at module top (the few deliberate exceptions are
listed below). Importing a submodule also runs its parent packages' ``__init__``; those
implicit edges are not counted -- the package ``__init__`` files are checked as modules."""
import ast
import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# folder -> package (pyproject.toml package-dir)
FOLDERS = {"dsv4_jax": "dsv4_jax", "ffi": "dsv4_jax.ffi", "kernels": "dsv4_jax.kernels",
           "models": "dsv4_jax.models", "checkpoints": "dsv4_jax.checkpoints"}

# Lowest first. A name ending in "." is a prefix (a whole subpackage); otherwise exact.
LAYERS = (
    ("config", ("dsv4_jax._xla_flags", "dsv4_jax.config", "dsv4_jax.quant",
                "dsv4_jax.kv_entry", "dsv4_jax.mesh_rules", "dsv4_jax.cache")),
    ("ops", ("dsv4_jax.kernels", "dsv4_jax.kernels.", "dsv4_jax.ffi", "dsv4_jax.ffi.")),
    ("models", ("dsv4_jax.models", "dsv4_jax.models.")),
    ("parameters", ("dsv4_jax.params", "dsv4_jax.sharding", "dsv4_jax.plan")),
    ("checkpoints", ("dsv4_jax.checkpoints", "dsv4_jax.checkpoints.")),
    ("generation", ("dsv4_jax._monitor", "dsv4_jax.compilation_cache", "dsv4_jax.sampling",
                    "dsv4_jax.chat", "dsv4_jax.tokenizer", "dsv4_jax.generation_options",
                    "dsv4_jax.decoding", "dsv4_jax.chat_decoding", "dsv4_jax.generation",
                    "dsv4_jax.speculative", "dsv4_jax.introspect")),
    ("public API", ("dsv4_jax",)),
    ("CLI", ("dsv4_jax.cli_generate", "dsv4_jax.cli_chat", "dsv4_jax.__main__")),
)

# Function-local imports of package modules that are there on purpose: the kernel path
# loads CuTe DSL only when a kernel is emitted (the reference path must work without it).
LAZY_BY_DESIGN = {
    ("dsv4_jax.ffi.sparse_attention", "dsv4_jax.ffi.cute_call"),
    ("dsv4_jax.ffi.sparse_attention", "dsv4_jax.kernels.sparse_attention_sm90_kernel"),
    ("dsv4_jax.ffi.grouped_gemm_sm90", "dsv4_jax.ffi.cute_call"),
    ("dsv4_jax.ffi.hc_sinkhorn_sm90", "dsv4_jax.ffi.cute_call"),
    ("dsv4_jax.ffi.hc_sinkhorn_sm90", "dsv4_jax.kernels.hc_sinkhorn_sm90"),
    ("dsv4_jax.ffi.hc_pre_sm90", "dsv4_jax.ffi.cute_call"),
    ("dsv4_jax.ffi.hc_pre_sm90", "dsv4_jax.kernels.hc_pre_sm90"),
    ("dsv4_jax.ffi.hc_mixes_sm90", "dsv4_jax.ffi.cute_call"),
    ("dsv4_jax.ffi.hc_mixes_sm90", "dsv4_jax.kernels.hc_mixes_sm90"),
    ("dsv4_jax.ffi.router_sm90", "dsv4_jax.ffi.cute_call"),
    ("dsv4_jax.ffi.router_sm90", "dsv4_jax.kernels.router_sm90"),
    ("dsv4_jax.ffi.indexer_sm90", "dsv4_jax.ffi.cute_call"),
    ("dsv4_jax.ffi.indexer_sm90", "dsv4_jax.kernels.index_scores_sm90"),
    ("dsv4_jax.ffi.indexer_sm90", "dsv4_jax.kernels.index_topk_sm90"),
    ("dsv4_jax.ffi.indexer_sm90", "dsv4_jax.kernels.index_topk_split_sm90"),
    ("dsv4_jax.ffi.grouped_gemm_sm90", "dsv4_jax.kernels.grouped_gemm_sm90_launch"),
    ("dsv4_jax.ffi.moe_schedule_sm90", "dsv4_jax.ffi.cute_call"),
    ("dsv4_jax.ffi.moe_schedule_sm90", "dsv4_jax.kernels.moe_schedule_sm90"),
    # The command line imports JAX-heavy modules only after its arguments parsed:
    # ``python -m dsv4_jax --help`` must not import JAX (tests/test_cli.py).
    ("dsv4_jax.cli_generate", "dsv4_jax"),
    ("dsv4_jax.cli_generate", "dsv4_jax.sampling"),
    ("dsv4_jax.cli_generate", "dsv4_jax.tokenizer"),
    ("dsv4_jax.cli_generate", "dsv4_jax.generation"),
    ("dsv4_jax.cli_generate", "dsv4_jax.compilation_cache"),
    ("dsv4_jax.cli_generate", "dsv4_jax._monitor"),
    ("dsv4_jax.cli_chat", "dsv4_jax.generation"),
    ("dsv4_jax.cli_chat", "dsv4_jax.compilation_cache"),
    ("dsv4_jax.__main__", "dsv4_jax.cli_generate"),
    ("dsv4_jax.__main__", "dsv4_jax.cli_chat"),
    ("dsv4_jax.__main__", "dsv4_jax.checkpoints.convert"),
}
# Function-local imports waiting to move to the module top. Delete entries as they go; none
# may be added.
PENDING: set = set()


def _modules() -> dict:
    """{module name: path} of every module the package installs."""
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


MODULES = _modules()


def layer_of(module: str) -> int:
    for rank, (_, names) in enumerate(LAYERS):
        for name in names:
            if module == name or (name.endswith(".") and module.startswith(name)):
                return rank
    raise KeyError(module)


def _imports(module: str, path: pathlib.Path):
    """(target module, line, at module top) for every import of a package module."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            # `from pkg import sub` imports the submodule; `from pkg import name` the package
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            if target == "dsv4_jax" or target.startswith("dsv4_jax."):
                yield target, node.lineno, id(node) in top


EDGES = [(m, *imp) for m, p in MODULES.items() for imp in _imports(m, p)]


def test_every_module_has_a_layer():
    missing = [m for m in MODULES if not any(
        m == n or (n.endswith(".") and m.startswith(n)) for _, names in LAYERS for n in names)]
    assert not missing, f"place these modules in LAYERS (and docs/architecture.md §1.2): {missing}"


def test_imports_point_down_the_layers():
    bad = [f"{src} line {line} imports {dst}: layer '{LAYERS[layer_of(dst)][0]}' is above "
           f"'{LAYERS[layer_of(src)][0]}'"
           for src, dst, line, _ in EDGES if layer_of(dst) > layer_of(src)]
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    graph = {m: set() for m in MODULES}
    for src, dst, _, _ in EDGES:
        if (src, dst) not in PENDING and dst in graph and dst != src:
            graph[src].add(dst)
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_package_imports_are_at_module_top():
    local = {(src, dst) for src, dst, _, at_top in EDGES if not at_top}
    unexpected = sorted(local - LAZY_BY_DESIGN - PENDING)
    assert not unexpected, ("move these imports to the module top (a cycle they dodge means a "
                            f"module is in the wrong layer): {unexpected}")


def test_every_module_imports_in_a_fresh_interpreter():
    names = [m for m in MODULES if m != "dsv4_jax.__main__"]
    if importlib.util.find_spec("cutlass") is None:     # the CuTe DSL kernel modules need it
        names = [m for m in names if not m.startswith("dsv4_jax.kernels.")]
    code = "import importlib\nfor m in %r:\n    importlib.import_module(m)\n" % names
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, cwd=ROOT)
