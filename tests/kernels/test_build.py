"""The kernel build's cache key: a library is named by every source and header of csrc/ and the
flags, so editing any part rebuilds it (the parts are headers of one translation unit)."""
from __future__ import annotations

import importlib
import shutil

# the module (the package's ``build`` is its build function)
build = importlib.import_module("sloserve.kernels.build")


def test_library_name_follows_every_source_and_header(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    monkeypatch.setattr(build, "CSRC", str(csrc))
    monkeypatch.setenv("SLOSERVE_KERNEL_DIR", str(tmp_path / "libs"))
    names = {p.rsplit("/", 1)[-1] for p in build.sources()}
    assert "kernels.cpp" in names and {"common.h", "parallel.h", "qlinear_x16.h"} <= names
    before = {v: build.library_path(v) for v in build.VARIANTS}
    assert len(set(before.values())) == len(build.VARIANTS)  # the flags are in the key
    assert all(p.startswith(str(tmp_path / "libs")) for p in before.values())
    header = csrc / "qlinear_x16.h"
    header.write_text(header.read_text() + "\n// an edit\n")
    after = {v: build.library_path(v) for v in build.VARIANTS}
    assert all(after[v] != before[v] for v in build.VARIANTS)
    (csrc / "notes.txt").write_text("not a source")  # other files are not part of the key
    assert {v: build.library_path(v) for v in build.VARIANTS} == after
