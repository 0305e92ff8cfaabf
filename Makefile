# qstore: `make demo` runs the end-to-end workload, `make test` runs every test.
# Everything either needs is installed here, into .venv.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
JAVA_STAMP := $(VENV)/.java-ok

.PHONY: all install java browser beanstalkd test test-fast check demo bench crash clean

all: test

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e ".[spark,dev,bench]"
	touch $@

install: $(STAMP)

# Spark needs Java 17+. On a Debian machine as root, install it with apt.
$(JAVA_STAMP): | $(PY)
	@if ! tools/java-version.sh >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "Installing openjdk-17-jre-headless (Spark needs Java 17+)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless; \
	  else \
	    echo "Java 17+ is required for Spark: install a JRE 17 or newer (e.g. openjdk-17-jre-headless)"; exit 1; \
	  fi; \
	fi
	@tools/java-version.sh
	touch $@

java: $(JAVA_STAMP)

# The audit report's screenshot test renders report.html in a headless browser:
# Debian's chromium, installed with apt as root; elsewhere that one test skips.
BROWSER_STAMP := $(VENV)/.browser-ok
$(BROWSER_STAMP): | $(PY)
	@if ! command -v chromium >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "Installing chromium (the report screenshot test)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; \
	  else \
	    echo "chromium not installed: the report screenshot test will skip"; \
	  fi; \
	fi
	touch $@

browser: $(BROWSER_STAMP)

# The server benchmark's peer is beanstalkd. On a Debian machine as root, install it with apt.
beanstalkd:
	@if ! command -v beanstalkd >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "Installing beanstalkd (the server benchmark's peer)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq beanstalkd; \
	  else \
	    echo "beanstalkd is not installed: the server benchmark leaves its figures out (on Debian: apt-get install beanstalkd)"; \
	  fi; \
	fi

test: $(STAMP) $(JAVA_STAMP) $(BROWSER_STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not spark and not slow"

check: $(STAMP)
	$(VENV)/bin/ruff check qstore tests tools spark
	$(VENV)/bin/mypy

demo: $(STAMP) $(JAVA_STAMP)
	$(VENV)/bin/qstore demo --dir demo-data --fresh

# The harness lives in tools/bench, outside the installed package:
# `make bench BENCH_ARGS=--quick` for a run of under a minute (docs/benchmarks.md).
BENCH_ARGS ?=
# The commit that added TTL, aging and rate limits (contract section 10): their
# cost to a queue that uses none of them is measured against its parent.
FEATURES_COMMIT := f21cc8a

bench: $(STAMP) beanstalkd
	PYTHONPATH=tools $(PY) -m bench $(BENCH_ARGS)
	$(PY) tools/feature_overhead.py git:$(FEATURES_COMMIT)^ git:$(FEATURES_COMMIT) --rounds 8 \
		--label "the features' commit against its parent"
	$(PY) tools/feature_overhead.py git:$(FEATURES_COMMIT)^ . --rounds 8 \
		--label "this tree against the commit before the features"

crash: $(STAMP)
	$(PY) tools/crash.py --kills 300

clean:
	rm -rf $(VENV) demo-data .pytest_cache .mypy_cache .ruff_cache
