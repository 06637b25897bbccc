# The README's two commands are `make compare` (the main job) and `make test`.
PY ?= python3
PYTEST_ARGS ?=

.PHONY: install test compare lint typecheck

install:
	$(PY) -m pip install -q -e '.[dev]'
	@command -v redis-server >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null) \
		|| echo "note: redis-server could not be installed; the redis tests will be skipped"

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

compare: install
	$(PY) -m sim compare

lint:
	$(PY) -m ruff check prototype sim tests

typecheck:
	$(PY) -m mypy
