# The two commands: `make run` (set up + run the main job) and `make test` (set up + run all tests).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test lint clean browser

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: setup
	$(BIN)/laminar run examples/tiny.toml --summary .laminar/summary.json

test: setup browser
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

# Headless Chromium for tests/test_report.py (Debian's package, through apt; needs root). Where apt is not
# usable it says so, and that test skips with the same reason.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& apt-get install -y -q chromium >/dev/null; } \
		|| echo "chromium not installed (apt-get install -y chromium needs root and a reachable Debian mirror): tests/test_report.py skips its browser test"

lint: setup
	$(BIN)/ruff check .

clean:
	-$(BIN)/laminar dev down
	rm -rf .laminar
