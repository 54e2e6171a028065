"""The seams everything depends on, as checks that can fail: the import-linter contracts in
pyproject.toml (scheduler/KV/request plain Python; the bench imports no engine, model or server
code; the model runner imports no scheduler; the engine core knows no HTTP; no layer imports the
CLI), and no import cycle among sloserve's modules."""
from __future__ import annotations

import os
import subprocess
import sys

import grimp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_linter_contracts_are_kept():
    exe = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    r = subprocess.run([exe, "--config", os.path.join(ROOT, "pyproject.toml")], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "5 kept, 0 broken" in r.stdout


def import_cycles(package: str) -> list[list[str]]:
    """Strongly connected components of more than one module in ``package``'s import graph
    (every import statement counts, function-level ones too)."""
    g = grimp.build_graph(package)
    adj = {m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}
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


def test_no_import_cycles():
    assert import_cycles("sloserve") == []


def test_the_cycle_finder_finds_cycles(tmp_path, monkeypatch):
    pkg = tmp_path / "cyclic"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyclic import b\n")
    (pkg / "b.py").write_text("def f():\n    from cyclic import a\n")
    (pkg / "c.py").write_text("from cyclic import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("cyclic") == [["cyclic.a", "cyclic.b"]]
