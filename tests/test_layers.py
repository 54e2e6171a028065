"""The seams everything depends on, as checks that can fail: the import-linter contracts in
pyproject.toml (the layers, top to bottom: cli; sim; server | bench | tools | router; engine |
roofline; executor | spec_decode; worker; kv_transfer; model; kernels; settings; plain data;
scheduler/KV/request and the KV connector's scheduler half plain Python; the bench imports no
engine, model or server code; the engine core knows no HTTP; the server imports no torch; the
router imports no torch and of the engine only its KV events and block hashes), every
module directly under sloserve placed in a layer, no import cycle among sloserve's modules nor
among its packages, and an API process that serves requests without importing torch."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib

import grimp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_linter_contracts_are_kept():
    exe = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    r = subprocess.run([exe, "--config", os.path.join(ROOT, "pyproject.toml")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "6 kept, 0 broken" in r.stdout


#: imports the package-level cycle check leaves out (and the layers contract ignores)
ALLOWED_PACKAGE_IMPORTS: set[tuple[str, str]] = set()


def _layers_contract() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    (layers,) = [c for c in contracts if c["type"] == "layers"]
    return layers


def test_every_module_under_sloserve_is_in_a_layer():
    placed = {m.strip() for layer in _layers_contract()["layers"]
              for m in layer.replace(":", "|").split("|")}
    children = {m for m in grimp.build_graph("sloserve").modules if m.count(".") == 1}
    assert children - placed == set()
    assert placed - children == set()


def test_the_allowed_imports_are_the_contracts_ignored_ones():
    ignored = {tuple(x.split(" -> ")) for x in _layers_contract().get("ignore_imports", [])}
    assert ignored == ALLOWED_PACKAGE_IMPORTS


def _sccs(adj: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node of the graph ``adj``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in adj.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in sorted(adj):
        if m not in index:
            visit(m)
    return out


def import_cycles(package: str) -> list[list[str]]:
    """Strongly connected components of more than one module in ``package``'s import graph
    (every import statement counts, function-level ones too)."""
    g = grimp.build_graph(package)
    return _sccs({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules})


def package_cycles(package: str, allowed: set[tuple[str, str]] = frozenset()) -> list[list[str]]:
    """Cycles among ``package``'s direct children (subpackages and modules; the package's own
    ``__init__`` is one more node): one imports the other when any module in it imports any
    module in the other, except the (importer, imported) module pairs in ``allowed``."""
    g = grimp.build_graph(package)

    def node(m: str) -> str:
        return ".".join(m.split(".")[:2])
    adj: dict[str, set[str]] = {node(m): set() for m in g.modules}
    for m in g.modules:
        for d in g.find_modules_directly_imported_by(m):
            if node(m) != node(d) and (m, d) not in allowed:
                adj[node(m)].add(node(d))
    return _sccs({k: sorted(v) for k, v in adj.items()})


def test_no_import_cycles():
    assert import_cycles("sloserve") == []


def test_no_package_cycles():
    assert package_cycles("sloserve", ALLOWED_PACKAGE_IMPORTS) == []


def test_the_cycle_finder_finds_cycles(tmp_path, monkeypatch):
    pkg = tmp_path / "cyclic"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyclic import b\n")
    (pkg / "b.py").write_text("def f():\n    from cyclic import a\n")
    (pkg / "c.py").write_text("from cyclic import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("cyclic") == [["cyclic.a", "cyclic.b"]]


def test_the_package_cycle_finder_finds_cycles(tmp_path, monkeypatch):
    """Packages a and b import each other through different modules: no module cycle, one
    package cycle, gone when one of the two imports is allowed."""
    root = tmp_path / "pkgs"
    for sub in ("a", "b", "c"):
        (root / sub).mkdir(parents=True)
        (root / sub / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "a" / "x.py").write_text("from pkgs.b import y\n")
    (root / "b" / "y.py").write_text("")
    (root / "b" / "z.py").write_text("def f():\n    from pkgs.a import w\n")
    (root / "a" / "w.py").write_text("")
    (root / "c" / "v.py").write_text("from pkgs.a import x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("pkgs") == []
    assert package_cycles("pkgs") == [["pkgs.a", "pkgs.b"]]
    assert package_cycles("pkgs", {("pkgs.b.z", "pkgs.a.w")}) == []


def test_the_api_process_serves_without_importing_torch():
    """The API process (the app, the front end, the embedded GGUF's tokenizer) answers a
    completion, a chat completion and structured-output requests (a good spec and a bad one),
    the engine core running in its own process, and torch (nor xgrammar, which loads it) is
    never imported in it."""
    code = textwrap.dedent("""
        import asyncio, sys
        import httpx
        from sloserve.config import EngineConfig
        from sloserve.server.api_server import run_server  # what `sloserve serve` imports
        from sloserve.server.app import create_engine_and_app

        engine, app = create_engine_and_app(EngineConfig(dtype="float32", num_kv_blocks=64,
                                                         max_model_len=256))
        async def ask():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://api") as c:
                r = await c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                assert r.status_code == 200, r.text
                r = await c.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
                assert r.status_code == 200, r.text
                # structured outputs: the spec is checked (xgrammar, which loads torch) in a
                # child process, so a bad one is still a 400 from this process
                r = await c.post("/v1/completions", json={
                    "prompt": "Hi", "max_tokens": 2, "structured_outputs": {"regex": "[0-9]+"}})
                assert r.status_code == 200, r.text
                r = await c.post("/v1/completions", json={
                    "prompt": "Hi", "max_tokens": 2, "structured_outputs": {"regex": "(("}})
                assert r.status_code == 400 and "structured_outputs" in r.text, r.text
        try:
            asyncio.run(ask())
        finally:
            engine.shutdown()
        print("torch modules:", sorted(m for m in sys.modules
                                       if m.split(".")[0] in ("torch", "xgrammar")))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "torch modules: []" in r.stdout, r.stdout[-2000:]
