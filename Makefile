# `make demo` and `make test` are all the set-up a fresh machine needs: both build .venv when it is missing or
# older than the requirements files.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO := demo
DEMO_MODEL := local/tiny-llama
# the README's one HF_HOME: the demo's model goes where the quick start's models go (set HF_HOME to use another)
export HF_HOME ?= $(CURDIR)/.cache/huggingface

.PHONY: venv demo test coverage test-fast smoke lint bench bench-chat bench-gpu gpu-check gpu-wheels clean-demo lm-eval

$(STAMP): requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $(STAMP)

# the environment alone, for running the stages by hand (source .venv/bin/activate)
venv: $(STAMP)

BENCH_STAMP := $(VENV)/.bench-installed

$(BENCH_STAMP): $(STAMP) requirements-bench.txt
	$(PY) -m pip install -q -r requirements-bench.txt
	touch $(BENCH_STAMP)

LM_EVAL_STAMP := $(VENV)/.lm-eval-installed

$(LM_EVAL_STAMP): $(STAMP) requirements-lm-eval.txt
	$(PY) -m pip install -q -r requirements-lm-eval.txt
	touch $(LM_EVAL_STAMP)

# lm-evaluation-harness (optional): --lm-eval-tasks on pipeline.evaluate and fsdp1.py
lm-eval: $(LM_EVAL_STAMP)

demo: $(STAMP) $(LM_EVAL_STAMP)
	$(PY) ORGANIZE_DATA.py --src_dir examples/raw --dst_root $(DEMO)/splits --num_dirs 4
	$(PY) DATA-HF.py --data_folder $(DEMO)/splits --save_dir $(DEMO)/hf_datasets/corpus --overwrite
	$(PY) -m pipeline.tiny --out $(DEMO)/tiny-llama --corpus examples/raw
	$(PY) MODEL_DOWNLOAD.py --model-name $(DEMO_MODEL) --source $(DEMO)/tiny-llama
	examples/demo_train.sh $(PY) $(DEMO)/outputs demo -d $(DEMO)/hf_datasets/corpus -m $(DEMO_MODEL) \
		--config configs/demo.yaml --sample-prompts examples/prompts/text.jsonl --sample-max-tokens 16 \
		--lm-eval-tasks corpus_cloze --lm-eval-include examples/lm_eval
	@echo
	@echo "== evaluate: the base and the fine-tuned model on the blocks the run held out (one command, any model), and"
	@echo "   on the local lm-eval task the run's config names"
	$(PY) -m pipeline.evaluate $(DEMO_MODEL) --config $(DEMO)/outputs/demo/config.yaml
	$(PY) -m pipeline.evaluate $(DEMO)/outputs/demo/hf --config $(DEMO)/outputs/demo/config.yaml \
		--out $(DEMO)/outputs/demo/eval.json
	@echo
	@echo "== chat: conversations only, loss on the assistant turns"
	$(PY) DATA-HF.py --data_folder examples/raw/chats --save_dir $(DEMO)/hf_datasets/chats --overwrite
	rm -rf $(DEMO)/outputs/chat
	$(PY) fsdp1.py --nproc-per-node 2 -e chat --save-dir $(DEMO)/outputs \
		-d $(DEMO)/hf_datasets/chats -m $(DEMO_MODEL) --config configs/demo_chat.yaml \
		--sample-prompts examples/prompts/chat.jsonl
	$(PY) -m pipeline.chat $(DEMO)/outputs/chat/hf --prompt "What is 12 plus 30?" --max-new-tokens 32
	@echo
	@echo "== LoRA: adapters on the chat model (frozen), taught a house style; the base answers, then the adapter"
	$(PY) DATA-HF.py --data_folder examples/lora --save_dir $(DEMO)/hf_datasets/chef --overwrite
	rm -rf $(DEMO)/outputs/chat-lora
	$(PY) fsdp1.py --nproc-per-node 2 -e chat-lora --save-dir $(DEMO)/outputs \
		-d $(DEMO)/hf_datasets/chef -m $(DEMO)/outputs/chat/hf --config configs/demo_lora.yaml
	$(PY) -m pipeline.chat $(DEMO)/outputs/chat/hf --prompt "How do I make soup?" --max-new-tokens 48
	$(PY) -m pipeline.chat $(DEMO)/outputs/chat-lora/adapter --prompt "How do I make soup?" --max-new-tokens 48
	@echo
	@echo "== DPO: LoRA adapters on the chat model taught from preference pairs to answer rather than brush a question"
	@echo "   off (the reference is the chat model: the adapters off); the run ends with its preference accuracy"
	$(PY) DATA-HF.py --data_folder examples/preferences --save_dir $(DEMO)/hf_datasets/pairs --overwrite
	rm -rf $(DEMO)/outputs/dpo
	$(PY) fsdp1.py --nproc-per-node 2 -e dpo --save-dir $(DEMO)/outputs \
		-d $(DEMO)/hf_datasets/pairs -m $(DEMO)/outputs/chat/hf --config configs/demo_dpo.yaml
	$(PY) -m pipeline.evaluate $(DEMO)/outputs/dpo/hf --reference $(DEMO)/outputs/chat/hf \
		--config $(DEMO)/outputs/dpo/config.yaml
	@echo
	@echo "== KTO: the same kind of adapters taught from single answers labelled good or bad (no pairs): the margin of"
	@echo "   the good answers' rewards over the bad ones' grows from 0"
	$(PY) DATA-HF.py --data_folder examples/kto --save_dir $(DEMO)/hf_datasets/feedback --overwrite
	rm -rf $(DEMO)/outputs/kto
	$(PY) fsdp1.py --nproc-per-node 2 -e kto --save-dir $(DEMO)/outputs \
		-d $(DEMO)/hf_datasets/feedback -m $(DEMO)/outputs/chat/hf --config configs/demo_kto.yaml
	@echo
	@echo "== reward model: the chat model trained whole to score the friendlier answer of each pair above the plain"
	@echo "   one; its export is an AutoModelForSequenceClassification, evaluated on the held-out pairs"
	rm -rf $(DEMO)/outputs/reward
	$(PY) fsdp1.py --nproc-per-node 2 -e reward --save-dir $(DEMO)/outputs \
		-d $(DEMO)/hf_datasets/pairs -m $(DEMO)/outputs/chat/hf --config configs/demo_reward.yaml
	$(PY) -m pipeline.evaluate $(DEMO)/outputs/reward/hf --config $(DEMO)/outputs/reward/config.yaml
	@echo
	@echo "== GRPO: online RL on arithmetic prompts; the two processes generate 4 completions of each prompt per step,"
	@echo "   score them (brevity, and the answer's accuracy) and train LoRA adapters on the base model from the"
	@echo "   advantages within each group; the held-out prompts' greedy mean reward rises as the model learns to stop"
	$(PY) DATA-HF.py --data_folder examples/grpo/prompts --save_dir $(DEMO)/hf_datasets/prompts --overwrite
	rm -rf $(DEMO)/outputs/grpo
	$(PY) fsdp1.py --nproc-per-node 2 -e grpo --save-dir $(DEMO)/outputs \
		-d $(DEMO)/hf_datasets/prompts -m $(DEMO_MODEL) --config configs/demo_grpo.yaml
	@echo
	@echo "== agents in RL: GRPO with an environment (examples/tools/environment.py:Calculator, TRL's environment_factory):"
	@echo "   one instance per rollout, its methods the model's tools (offered through Llama 3.1's template), its"
	@echo "   get_reward a reward of its own beside answered; a model this small calls no tool yet (the wiring, not learning)"
	$(PY) DATA-HF.py --data_folder examples/tools/prompts --save_dir $(DEMO)/hf_datasets/tool_prompts --overwrite
	rm -rf $(DEMO)/outputs/tools
	$(PY) fsdp1.py --nproc-per-node 2 -e tools --save-dir $(DEMO)/outputs \
		-d $(DEMO)/hf_datasets/tool_prompts -m $(DEMO)/outputs/chat/hf --config configs/demo_tools.yaml
	@echo
	@echo "== agents: tool calls and reasoning traces through Qwen3's template (its history rewritten turn by turn),"
	@echo "   mixed 0.7/0.3 with the conversations; the log says what each source gave and each has its eval loss"
	$(PY) DATA-HF.py --data_folder examples/agents --save_dir $(DEMO)/hf_datasets/agents --overwrite
	rm -rf $(DEMO)/outputs/agents
	$(PY) fsdp1.py --nproc-per-node 2 -e agents --save-dir $(DEMO)/outputs -m $(DEMO)/outputs/chat/hf \
		-d $(DEMO)/hf_datasets/agents:0.7,$(DEMO)/hf_datasets/chats:0.3 --config configs/demo_agents.yaml
	@echo
	@echo "demo outputs:"
	@echo "  splits + manifest:   $(DEMO)/splits/manifest.jsonl"
	@echo "  Arrow dataset:       $(DEMO)/hf_datasets/corpus (report: prep_report.json inside it)"
	@echo "  tiny model (random): $(DEMO)/tiny-llama, imported as $(DEMO_MODEL) into $(HF_HOME)"
	@echo "  training run:        $(DEMO)/outputs/demo (metrics.jsonl, loss.png, train.log, checkpoints/, hf/,"
	@echo "                       lm_eval.json: the lm-eval task on hf/, eval.json: pipeline.evaluate of hf/)"
	@echo "  chat run:            $(DEMO)/outputs/chat (try it: $(PY) -m pipeline.chat $(DEMO)/outputs/chat/hf)"
	@echo "  LoRA run:            $(DEMO)/outputs/chat-lora (adapter/ in PEFT's format on chat/hf, hf/ merged)"
	@echo "  DPO run:             $(DEMO)/outputs/dpo (metrics.jsonl: rewards/* and logps/* per window and eval)"
	@echo "  KTO run:             $(DEMO)/outputs/kto (metrics.jsonl: kl, rewards/* and logps/* per window and eval)"
	@echo "  reward model:        $(DEMO)/outputs/reward (hf/: AutoModelForSequenceClassification; accuracy, margin)"
	@echo "  GRPO run:            $(DEMO)/outputs/grpo (metrics.jsonl: reward, rewards/*, completions/*; sample events)"
	@echo "  GRPO with tools:     $(DEMO)/outputs/tools (metrics.jsonl: rewards/Calculator, tools/*, episodes/*)"
	@echo "  agents run:          $(DEMO)/outputs/agents (metrics.jsonl: eval/loss/agents and eval/loss/chats)"

# Two pytest workers, one test file each at a time (module fixtures stay shared), the longest files first
# (tests/conftest.py; xdist's own order, by number of tests, dealt the 3-minute GPU rehearsal last). A test's torchrun
# and fsdp1.py runs start warm (tests/helpers/warm_launcher.py: imports were about two thirds of a short run's CPU):
# 506 tests took 13:36 and 14:17 on the 2-core AVX2 EPYC on 2026-11-27, against 25:09 the same day before (every run
# a fresh interpreter, as FSDP1_TESTS_COLD=1 still starts them); 515 tests 18:33 in xdist's order and 18:04
# longest first, using 1.15 of the 2 cores on average (user + sys over wall time)
# (--durations 15: the slowest tests at the end of every run, CI's included, so growth is seen when it happens).
# One thread per process (TEST_THREADS): two workers fill the two cores, and a test's processes run beside the other
# worker's, where torch's thread per core only spins against them: 584 tests took 14:53 with it and 15:49 without,
# the same commit on the same machine on 2026-11-27
TEST_THREADS := OMP_NUM_THREADS=1
test: $(STAMP) $(LM_EVAL_STAMP)
	$(TEST_THREADS) $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations 15

# Line coverage of pipeline/ over the whole suite, the workers of every run included (pyproject's [tool.coverage]);
# the report's last line is the total
coverage: $(STAMP) $(LM_EVAL_STAMP)
	rm -rf .cache/coverage && mkdir -p .cache/coverage
	$(TEST_THREADS) $(PY) -m coverage run -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder
	$(PY) -m coverage combine -q
	$(PY) -m coverage report --skip-covered --sort cover

# The edit-run loop: the tests that start no process (tests/conftest.py marks the others slow)
test-fast: $(STAMP)
	$(TEST_THREADS) $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow"

# Every strategy a few steps with a checkpoint and a resume, through the experiments harness
smoke: $(STAMP)
	examples/smoke.sh $(PY) $(DEMO)

# The CPU benchmarks (about 12 minutes on 2 cores): rewrites the tables of BENCHMARKS.md and bench/charts/*.png
bench: $(BENCH_STAMP)
	$(PY) bench/data_prep.py --num_proc 2 --target_mb 100 --repeats 5 --workdir .bench/data --write
	$(PY) bench/tokenize_pack.py --num_proc 2 --target_mb 10 --repeats 3
	$(PY) bench/train_speed.py --repeats 3
	$(PY) bench/checkpoint_io.py --repeats 2
	$(PY) bench/startup.py --repeats 2
	$(PY) bench/cache_scaling.py --sizes 40 160 320 --num_proc 2
	$(PY) bench/eval_cost.py

# Chat fine-tuning against TRL's SFTTrainer (about 20 minutes on 2 cores: TRL's steps take about a minute there);
# rewrites the chat_speed_cpu table of BENCHMARKS.md
bench-chat: $(BENCH_STAMP)
	$(PY) bench/chat_speed.py --repeats 2

# The GPU table (one CUDA GPU, about 15 minutes; the model's checkpoints need 30 GB of disk): Llama-3.2-1B's shape,
# fsdp1.py variants against the HF Trainer; rewrites the train_speed_gpu table of BENCHMARKS.md
bench-gpu: $(BENCH_STAMP)
	$(PY) bench/train_speed_gpu.py --variants all --batch 8,16 --write

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean-demo:
	rm -rf $(DEMO)

# Everything GPU-only (bench/gpu_check.py) in parts of a window, each one device call of at most 300 s: HALF=1
# (setup, adapters), HALF=2 (setup, correctness, full_speed, grpo), HALF=3 (setup, long_context), HALF=4 (setup, moe:
# 2 GPUs); none: all in one call. On the GPU machine, whose image has torch but lacks some wheels (`make gpu-wheels` here first, and carry
# .whl), it runs with the image's python; DRY=1 rehearses every part on this machine's CPU with tiny shapes
# (tests/test_gpu_check.py runs it). PARTS=a,b runs those parts only; GPU_CHECK_ARGS passes more (--workdir, --results).
gpu-check: $(if $(DRY),$(STAMP) $(LM_EVAL_STAMP))
	$(if $(DRY),$(PY),$(PYTHON)) bench/gpu_check.py $(if $(DRY),--dry) $(if $(HALF),--half $(HALF)) \
		$(if $(PARTS),--parts $(PARTS)) $(GPU_CHECK_ARGS)

# The wheels the GPU image lacks or has at other versions (transformers 5.17 there on 2026-11-26), at this project's
# pins, into .whl/ (../shared/gpu/wheels.sh); regex because transformers checks its version at import
gpu-wheels:
	../shared/gpu/wheels.sh regex==2026.11.19 \
	  $(shell grep -hE '^(transformers|tokenizers|peft|torchao|accelerate)==' requirements.txt requirements-bench.txt)
