# Two commands for a fresh clone: `make demo` and `make test`. Each creates .venv when missing.
# torch is pinned first so that pip keeps the CPU build instead of pulling a multi-GB CUDA one.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

$(BIN)/specmoe: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

.PHONY: install demo test bench bench-report bench-smoke anchors
install: $(BIN)/specmoe

demo: install
	$(BIN)/specmoe info
	$(BIN)/specmoe generate "The built-in function len returns" --max-tokens 48
	$(BIN)/specmoe generate --model specmoe-demo-translate --src-lang eng_Latn --tgt-lang fra_Latn \
		"Save changes to the document before closing?" --max-tokens 32 --policy specmoe --device-memory 30%
	$(BIN)/specmoe generate --prompts-file benchmarks/prompts/heldout.jsonl --num-prompts 16 \
		--max-tokens 32 --policy specmoe --offload disk --device-memory 30% --batch-size 16 > /dev/null

# PYTHONDONTWRITEBYTECODE emptied: where it is set, pytest rewrote every test module's asserts
# anew in each worker (6 of the 20 s collection takes there); the bytecode goes to the
# ignored __pycache__ folders.
test: install
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -rs -n 2 --dist loadfile tests

# BENCHMARKS.md: every command behind it (about an hour on 2 cores; run on a quiet machine),
# each writing one JSON into bench-results/, then every section rewritten from them.
bench: install
	$(BIN)/python benchmarks/run_all.py --results bench-results --markdown BENCHMARKS.md

# Rewrite BENCHMARKS.md's sections, its summary and README's headline table from the JSON
# committed in benchmarks/results/ (make bench keeps each measured section's documents there)
# without running anything.
bench-report: install
	$(BIN)/specmoe bench --report benchmarks/results --markdown BENCHMARKS.md

# Every command in its reduced form (minutes): proves the commands and the report work.
bench-smoke: install
	$(BIN)/python benchmarks/run_all.py --smoke --results bench-smoke

# llama.cpp for `specmoe bench --anchors llama.cpp`: llama-cpp-python builds it from source (tens of
# minutes on 2 cores; JOBS=N to use more), without its examples, tools and multimodal library.
# On a CPU with AMX its native build dies at its first product (SIGILL: an AMX tile instruction
# in a worker thread, llama-cpp-python 0.3.36 on a Xeon with amx_tile), so there it is built for
# AVX-512 without AMX: the kernels it runs on AVX-512 CPUs without AMX, weights repacked as usual.
JOBS ?= 1
NO_AMX := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
	-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
LLAMA_CPU := $(if $(shell grep -qw amx_tile /proc/cpuinfo 2>/dev/null && echo amx),$(NO_AMX))
anchors: install
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF \
		-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF $(LLAMA_CPU)" \
		$(BIN)/pip install -e '.[anchors]'
