# The two commands of the README: `make bench` and `make test`. Both build .venv from nothing.
# torch is pinned here and only here. To use a torch you already have (a CUDA build, say), create the venv
# with it visible: `make test VENV_FLAGS=--system-site-packages`; an importable torch is never replaced.
PYTHON      ?= python3
VENV        ?= .venv
VENV_FLAGS  ?=
TORCH_SPEC  ?= torch==2.13.0
TRITON_SPEC ?= triton==3.9.0
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip
BUILD_DEPS  := pybind11 ninja
BUILD_STAMP := $(VENV)/.fastlib-build-deps
DEPS        := numpy webdataset pytest pytest-xdist matplotlib tqdm Pillow simplejpeg hypothesis
DEPS_STAMP  := $(VENV)/.fastlib-deps
STAMP       := $(VENV)/.fastlib-installed
# The frameworks tests/fastcomm/test_integrations.py runs the hooks under. Installed with --no-deps (their own
# pins would resolve a torch), with the pure-Python packages they need to import; the tests skip without them.
INTEGRATIONS ?= accelerate==1.15.0 lightning==2.6.6 pytorch_lightning==2.6.6 lightning_utilities==0.15.3 \
                torchmetrics==1.9.0 huggingface_hub==2.4.0 safetensors==0.8.0 psutil==7.2.2
INTEGRATIONS_STAMP := $(VENV)/.fastlib-integrations
# fastio's remote sources (fsspec; http(s) needs aiohttp), .tar.zst shards, and the S3 tests' moto server + s3fs.
# All torch-free; the tests that need one skip with its name when it is absent.
# s3fs pins aiobotocore, which pins botocore: unpinned, pip walked 23 boto3/botocore versions (minutes) to
# find the pair, so the set that resolved is pinned here.
REMOTE      ?= "fsspec>=2024.2" "aiohttp>=3.9" "requests>=2.31" "zstandard>=0.22" "moto[server]==5.2.5" \
               s3fs==2026.9.0 aiobotocore==3.10.0 boto3==1.43.117 botocore==1.43.117
# fastcomm.ft (live recovery on torchft's Manager and Lighthouse): torchft pins a torch of its own, so --no-deps,
# with the three pure-Python packages its import needs, pinned. fastio's Parquet format reads through pyarrow.
FT          ?= torchft==0.2.0
FT_DEPS     ?= opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
PARQUET     ?= pyarrow==26.0.1
# The peers bench_loader and bench_images time beside fastio (benchmarks/peers.py), and tests/test_peers.py: pinned and
# --no-deps (their own requirements would resolve another torch); they import without requests/urllib3. SPDL's image
# decode also needs FFmpeg 4-9 shared libraries, which pip does not provide (Debian 12: apt-get install
# libavformat59 libavfilter8 libavdevice59); without them, or when this install fails, the rows say why.
PEERS       ?= torchdata==0.11.0 spdl==0.8.0 spdl-core==0.8.0 spdl-io==0.8.0
PEERS_STAMP := $(VENV)/.fastlib-peers
# bench_parquet's Hugging Face row, for `make bench` only (no test needs it; pandas alone is ~30 s of install):
# `datasets` --no-deps (its fsspec cap would move the REMOTE pins), then its torch-free requirements with theirs.
HF_DATASETS ?= datasets==5.2.0
HF_DEPS     ?= dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 pandas==3.1.1 huggingface_hub==2.4.0
HF_STAMP    := $(VENV)/.fastlib-hf-datasets
NATIVE_SRC  := setup.py pyproject.toml $(wildcard csrc/*/*.cpp csrc/*/*.h csrc/*/*.cu csrc/*/*.cuh)

.PHONY: test bench install lint clean

$(PY):
	$(PYTHON) -m venv $(VENV_FLAGS) $(VENV)

# What the native build needs (torch only where not importable; it brings the setuptools the build uses): the
# compiler starts as soon as it is in, while pip installs the rest beside it.
$(BUILD_STAMP): $(PY)
	$(PIP) install $$($(PY) -c "import torch" 2>/dev/null || echo '$(TORCH_SPEC)') $(BUILD_DEPS)
	touch $@

# Everything else the tests import (triton only where not importable), beside torch's own install: no package
# of DEPS (nor of their requirements) is torch's or one of its requirements, so the two pips never write the
# same files, and a fresh install no longer waits for one unpacking before the next starts. A package added to
# DEPS that torch also needs belongs after $(BUILD_STAMP), like the two below.
$(DEPS_STAMP): $(PY)
	$(PIP) install $$($(PY) -c "import triton" 2>/dev/null || echo '$(TRITON_SPEC)') $(DEPS)
	touch $@

# The native build; its dependencies are all in place, so pip resolves nothing (--no-deps).
$(STAMP): $(BUILD_STAMP) $(NATIVE_SRC)
	$(PIP) install --no-build-isolation --no-deps -e .
	touch $@

# Needs no build: `make install` runs it beside the compiler (pip mostly waits on the index and the disk).
# `make bench` needs it too: bench_shuffle and bench_remote read shards over HTTP (aiohttp). After torch's
# install: REMOTE wants fsspec, which torch brings too.
$(INTEGRATIONS_STAMP): $(BUILD_STAMP) $(DEPS_STAMP) Makefile
	$(PIP) install --no-deps $(INTEGRATIONS)
	$(PIP) install $(REMOTE) $(FT_DEPS) $(PARQUET)
	$(PIP) install --no-deps $(FT)
	touch $@

# Not fatal: a benchmark whose peer is missing writes the reason in its row instead.
$(PEERS_STAMP): $(BUILD_STAMP) $(DEPS_STAMP) Makefile
	$(PIP) install --no-deps $(PEERS) && touch $@ || echo "peers not installed; their benchmark rows will say why"

# After the REMOTE pins (fsspec) are in. Not fatal either: bench_parquet's row then says why.
$(HF_STAMP): $(INTEGRATIONS_STAMP) Makefile
	$(PIP) install --no-deps $(HF_DATASETS) && $(PIP) install $(HF_DEPS) && touch $@ \
	    || echo "datasets not installed; bench_parquet's row will say why"

# The peers too (a few seconds, --no-deps), so that CI runs tests/test_peers.py rather than skipping it.
install:
	$(MAKE) --no-print-directory -j2 --output-sync=target $(STAMP) $(DEPS_STAMP) $(INTEGRATIONS_STAMP) $(PEERS_STAMP)

# Two pytest runs side by side: the op tests on the pure-PyTorch fallback (FASTCOMM_NO_NATIVE=1 is honoured at
# import as well as at build time; `-m "not large"`: there the op under test is the reference, so the sizes
# kept for the native kernels' many-chunk paths add nothing), and the whole suite with the native kernels on
# TEST_WORKERS pytest-xdist workers, a test file to a worker. The fallback pass (one process) fills the time
# the suite's workers spend waiting on their ranks' start-up, a peer's timeout or a torchrun restart; its
# output follows the suite's. TEST_WORKERS=0 runs the suite in one process. The bytecode of our own modules is
# written first: every rank and torchrun worker imports them, and where PYTHONDONTWRITEBYTECODE is set
# (this machine) each would compile them again (~0.1 s of CPU a process). Every process runs TEST_THREADS
# intra-op threads (tests/conftest.py reads FASTLIB_TEST_THREADS; spawned ranks OMP_NUM_THREADS): with the
# processes side by side on 2 cores, a second thread per process only spins at the end of each parallel
# loop waiting for a thread the scheduler took away (test_ops_into's top-k grid: half the CPU time on 1).
# test_ops.py runs the native loops on 1, 2 and 3 threads itself. Three workers on 2 cores: a quarter of
# the suite's wall time is waiting (ranks starting, a peer's timeout, a torchrun restart), which a third
# worker fills (measured in a cgroup: 549 s of CPU either way, 334 s of wall on 2 workers, 317 s on 3).
TEST_WORKERS ?= 3
TEST_THREADS ?= 1
NO_NATIVE_TESTS := tests/fastcomm/test_ops.py tests/fastcomm/test_ops_table.py tests/fastcomm/test_ops_into.py \
                   tests/fastcomm/test_ops_into_checks.py tests/fastio/test_no_native.py
# Tests marked `alone` (gloo timed against the advisor's model) run after the suite, on an idle machine: beside
# it the load reached 7-10 on 2 cores and they skipped (saying so), measuring nothing.
ALONE_TESTS := tests/fastcomm/test_advise.py
test: install
	@$(PY) -m compileall -q fastcomm fastio examples benchmarks tests >/dev/null
	@log=$$(mktemp); export FASTLIB_TEST_THREADS=$(TEST_THREADS) OMP_NUM_THREADS=$(TEST_THREADS); \
	FASTCOMM_NO_NATIVE=1 FASTIO_NO_NATIVE=1 $(PY) -m pytest -q -p no:cacheprovider -m "not large" \
	    $(NO_NATIVE_TESTS) >$$log 2>&1 & fallback=$$!; \
	$(PY) -m pytest -q -p no:cacheprovider --durations=20 -n $(TEST_WORKERS) --dist loadfile \
	    --no-loadscope-reorder -m "not alone" tests; suite=$$?; \
	wait $$fallback; status=$$?; \
	echo "== the op tests without the native kernels (FASTCOMM_NO_NATIVE=1 FASTIO_NO_NATIVE=1):"; \
	cat $$log; rm -f $$log; \
	echo "== the timing tests, alone:"; \
	$(PY) -m pytest -q -p no:cacheprovider -m alone $(ALONE_TESTS); alone=$$?; \
	test $$suite -eq 0 && test $$status -eq 0 && test $$alone -eq 0

# The short profile (under 20 min on 2 cores); FULL=1 runs every benchmark in full (about 2 h).
# Results go to benchmarks/runs/<UTC time>/; UPDATE_RESULTS=1 writes the committed benchmarks/results/ instead,
# in full.
bench: install $(HF_STAMP)
	$(PY) -m benchmarks.run_all $(if $(filter 1 yes true,$(FULL)),--full) $(if $(filter 1 yes true,$(UPDATE_RESULTS)),--update-results)

lint: $(STAMP)
	$(PIP) install ruff
	$(VENV)/bin/ruff check fastcomm fastio tests benchmarks

clean:
	rm -rf build *.egg-info fastcomm/_C*.so fastio/_C*.so
