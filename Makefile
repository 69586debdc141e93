# fsdp: one-word entry points. Everything builds into build/ (binaries in build/bin/).
# A fresh Debian 12 machine needs only `make run` and `make test`: every target that builds first installs
# the missing Debian packages (scripts/deps.sh, silent when nothing is missing).
#   make deps    install the missing Debian packages (apt) and nothing else
#   make build   deps, configure + build
#   make test    build, then run every test through CTest
#   make run     build fsdp-train only, then train the default deck inputs/mnist_fsdp.toml on 2 ranks (NP=, DECK=)
#   make bench   build what it needs, then fsdp-train vs PyTorch DDP/FSDP, MPI and checkpoint bandwidth -> build/bench/results.md (~70 min with the 5.8M-124M GPTs; BENCH_MODELS=cnn,gpt: ~15 min; BENCH_QUICK=1: ~5 min smoke test)
#   make check-gpu  build, then run the GPU tests (ctest -L gpu); fails when they were all skipped (no CUDA device)
BUILD_DIR ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)
NP ?= 2
MPIRUN ?= mpirun --oversubscribe --allow-run-as-root

export CCACHE_DIR ?= $(HOME)/.cache/ccache
# PCH with ccache needs these.
export CCACHE_SLOPPINESS = pch_defines,time_macros,include_file_mtime,include_file_ctime
export OMPI_MCA_mpi_yield_when_idle = 1

# Looked up when configure runs, after deps: on a fresh machine deps has just installed ccache.
CCACHE_FLAGS = $(if $(shell command -v ccache 2>/dev/null),-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
CMAKE_FLAGS = -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CCACHE_FLAGS)

.PHONY: deps build test run clean
.PHONY: check-gpu format

# Formats every C++ file with the root .clang-format (clang-format from `make deps`).
format:
	git ls-files '*.hpp' '*.cpp' '*.h' | xargs clang-format -i

deps:
	@bash scripts/deps.sh

# Order-only: deps runs before every configure and build, yet never forces a reconfigure.
$(BUILD_DIR)/CMakeCache.txt: | deps
	cmake -S . -B $(BUILD_DIR) $(CMAKE_FLAGS)

build: $(BUILD_DIR)/CMakeCache.txt | deps
	cmake --build $(BUILD_DIR) -j $(JOBS)

# Tests run side by side up to the machine's cores, by the cores each declares (tests/CMakeLists.txt).
test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS)

# The NCCL communicator's tests (docs/gpu.md): needs FSDP_WITH_NCCL (on when CUDA and NCCL are found);
# without a CUDA device the ones that need it are reported as skipped ("Not Run"), never as passed, and
# check-gpu then fails: nothing was verified.
check-gpu: build
	@grep -q '^FSDP_WITH_NCCL:BOOL=ON' $(BUILD_DIR)/CMakeCache.txt || \
	  { echo "check-gpu: FSDP_WITH_NCCL is off in $(BUILD_DIR) (no CUDA toolkit or NCCL found); see docs/gpu.md"; exit 1; }
	@bash scripts/check_gpu.sh $(BUILD_DIR)

# The tutorial's experiment: the CNN on Fashion-MNIST, FULL_SHARD, 2 epochs (about 2-3 minutes on 2
# cores). A fresh run each time; run fsdp-train directly to resume an interrupted one. Builds only
# fsdp-train: a first run never waits for the test suites.
DECK ?= inputs/mnist_fsdp.toml
RUN_ARGS ?= --set checkpoint.resume=none
run: $(BUILD_DIR)/CMakeCache.txt | deps
	cmake --build $(BUILD_DIR) -j $(JOBS) --target fsdp-train
	$(MPIRUN) -np $(NP) $(BUILD_DIR)/bin/fsdp-train $(DECK) $(RUN_ARGS)

# Benchmarks side by side and interleaved (bench/run_bench.py): fsdp-train (FULL_SHARD, SHARD_GRAD_OP,
# NO_SHARD) against the PyTorch peer bench/train_peer.py (DDP, PyTorch FSDP) at 1, 2 and 4 ranks.
# Builds only what it runs.
.PHONY: bench
bench: $(BUILD_DIR)/CMakeCache.txt | deps
	cmake --build $(BUILD_DIR) -j $(JOBS) --target bench_programs
	/usr/bin/python3 bench/run_bench.py
	@# Memory at default settings, 134M GPT at 4 ranks (~6 min; not in the quick run; BENCH_LEAN=0 skips it).
	@if [ "$${BENCH_QUICK:-0}" = 0 ] && [ "$${BENCH_LEAN:-1}" != 0 ]; then bash bench/lean_memory.sh; fi

clean:
	rm -rf $(BUILD_DIR)
