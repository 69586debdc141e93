# Weights in and out end to end (docs/interop.md): fsdp-train exports a GPT with a padded vocabulary and
# GPT-2's tanh GELU as a Hugging Face GPT-2 folder from its live shards; fsdp-ckpt exports the same
# checkpoint to the same tensors; runs at np 1, 2 and 3 start from that folder, from the native
# export and from the checkpoint file and train alike; bad pretrained files end every rank with exit
# code 2 naming the tensor. Variables: MPIEXEC (list), TRAIN, CKPT_TOOL, DECK (inputs/gpt_tokens.toml),
# PYTHON, WORK_DIR, SOURCE_DIR.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
include(${CMAKE_CURRENT_LIST_DIR}/e2e_common.cmake)
set(st_diff ${PYTHON} ${CMAKE_CURRENT_LIST_DIR}/safetensors_diff.py)

# A small GPT-2: vocabulary 97 padded to 128 rows, tanh GELU, no dropout.
set(gpt --set model.vocab_size=97 --set model.vocab_pad_multiple=32 --set model.activation=gelu_tanh --set model.d_model=32
        --set model.n_heads=4 --set model.n_layers=2 --set model.context=16 --set model.dropout=0 --set data.num_samples=240
        --set log.progress=plain --set run.threads=1 --set checkpoint.every_steps=0)

# 1. Train 6 steps at np 2 and export at the end as a Hugging Face GPT-2 folder.
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.max_steps=6 --set data.batch_size=4 --set run.out_dir=${WORK_DIR}/a
    --set checkpoint.export=hf --set checkpoint.export_names=hf-gpt2)
expect_in("${last_output}" "exported 28 tensors \\(hf-gpt2 names\\)")
file(READ ${WORK_DIR}/a/hf/config.json config)
foreach(pair "\"model_type\": \"gpt2\"" "\"vocab_size\": 97" "\"n_embd\": 32" "\"n_layer\": 2" "\"n_head\": 4" "\"n_positions\": 16"
        "\"activation_function\": \"gelu_new\"" "\"layer_norm_epsilon\": 1e-05" "\"GPT2LMHeadModel\"" "\"tie_word_embeddings\": true")
  expect_in("${config}" "${pair}")
endforeach()
# The same checkpoint exported by fsdp-ckpt (no MPI, no LibTorch) holds the same tensors bit for bit:
# GPT-2's names, Conv1D weights transposed, 97 of the 128 embedding rows.
run(0 ${CKPT_TOOL} export ${WORK_DIR}/a/checkpoints ${WORK_DIR}/a/hf_ckpt --names hf-gpt2)
run(0 ${st_diff} ${WORK_DIR}/a/hf/model.safetensors ${WORK_DIR}/a/hf_ckpt/model.safetensors)
run(0 ${CMAKE_COMMAND} -E compare_files ${WORK_DIR}/a/hf/config.json ${WORK_DIR}/a/hf_ckpt/config.json)
file(READ ${WORK_DIR}/a/hf/model.safetensors head OFFSET 8 LIMIT 4000)
foreach(name transformer.wte.weight\":{\"dtype\":\"F32\",\"shape\":\\[97,32\\] transformer.h.1.attn.c_attn.weight\":{\"dtype\":\"F32\",\"shape\":\\[32,96\\]
        transformer.h.0.mlp.c_fc.weight\":{\"dtype\":\"F32\",\"shape\":\\[32,128\\] transformer.h.0.mlp.c_proj.weight\":{\"dtype\":\"F32\",\"shape\":\\[128,32\\])
  expect_in("${head}" "${name}")
endforeach()
run(0 ${CKPT_TOOL} export ${WORK_DIR}/a/checkpoints ${WORK_DIR}/a/native.safetensors)
# FULL and LOCAL checkpoints of the same training export to the same tensors.
foreach(type FULL LOCAL)
  run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.max_steps=6 --set data.batch_size=4 --set run.out_dir=${WORK_DIR}/a_${type}
      --set checkpoint.state_dict_type=${type}_STATE_DICT)
  run(0 ${CKPT_TOOL} export ${WORK_DIR}/a_${type}/checkpoints ${WORK_DIR}/a_${type}/hf --names hf-gpt2)
  run(0 ${st_diff} ${WORK_DIR}/a/hf/model.safetensors ${WORK_DIR}/a_${type}/hf/model.safetensors)
endforeach()
# A config.json of another model where the export would go (a downloaded model's folder, a bare file
# name in a folder holding one) is never replaced: fsdp-ckpt exits 2 before writing anything, fsdp-train
# (np 3) before its first step. This model's own config (a re-export, also in another dtype) is replaced.
run(0 ${CKPT_TOOL} export ${WORK_DIR}/a/checkpoints ${WORK_DIR}/a/hf_ckpt --names hf-gpt2)
run(0 ${CKPT_TOOL} export ${WORK_DIR}/a/checkpoints ${WORK_DIR}/a/hf_ckpt --names hf-gpt2 --dtype bf16)
file(WRITE ${WORK_DIR}/downloaded/config.json "{\"model_type\": \"llama\"}\n")
run(2 ${CKPT_TOOL} export ${WORK_DIR}/a/checkpoints ${WORK_DIR}/downloaded/model.safetensors --names hf-gpt2)
expect_in("${last_output}" "downloaded/config.json' exists and describes another model than this export's .*nothing written")
run(2 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${gpt} --set run.max_steps=6 --set data.batch_size=4 --set run.out_dir=${WORK_DIR}/into_downloaded
    --set checkpoint.export=${WORK_DIR}/downloaded --set checkpoint.export_names=hf-gpt2)
expect_in("${last_output}" "downloaded/config.json' exists and describes another model .*set checkpoint.export to a folder of its own")
if(last_output MATCHES "step 1/")
  message(FATAL_ERROR "fsdp-train trained before refusing the export folder:\n${last_output}")
endif()
file(READ ${WORK_DIR}/downloaded/config.json kept)
expect_in("${kept}" "^{\"model_type\": \"llama\"}")
if(EXISTS ${WORK_DIR}/downloaded/model.safetensors)
  message(FATAL_ERROR "an export was written beside another model's config.json")
endif()

# 2. Pretrained starts: from the Hugging Face folder at np 3, the native file at np 2 and the checkpoint
#    file at np 1 (the same weights), 6 more steps with one global batch of 6: the same training (SGD
#    with momentum, so that every tensor can be held to 1e-5; Adam's g/sqrt(v) amplifies summation-order
#    rounding of near-zero gradients).
#    The runs export GPT-2's tensors, which leave out the vocabulary padding: the padded rows are never
#    used, and a start from the Hugging Face folder (which does not store them) keeps their initialization.
set(start --set run.max_steps=6 --set run.seed=5 --set optim.kind=sgd --set optim.lr=0.05 --set optim.momentum=0.9
          --set optim.weight_decay=0 --set optim.warmup_steps=0 --set fsdp.auto_wrap_policy=SIZE_BASED_WRAP --set fsdp.min_num_params=3000
          --set checkpoint.export=final --set checkpoint.export_names=hf-gpt2)
run(0 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${gpt} ${start} --set data.batch_size=2 --set run.out_dir=${WORK_DIR}/from_hf
    --set checkpoint.init_from=${WORK_DIR}/a/hf)
expect_in("${last_output}" "initialized the model from [^\n]*a/hf \\(hf-gpt2 names\\)")
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} ${start} --set data.batch_size=3 --set run.out_dir=${WORK_DIR}/from_native
    --set checkpoint.init_from=${WORK_DIR}/a/native.safetensors)
expect_in("${last_output}" "\\(native names\\)")
file(GLOB a_final ${WORK_DIR}/a/checkpoints/step_*.h5)
run(0 ${MPIEXEC} -np 1 ${TRAIN} ${DECK} ${gpt} ${start} --set data.batch_size=6 --set run.out_dir=${WORK_DIR}/from_ckpt
    --set checkpoint.init_from=${a_final})
run(0 ${st_diff} ${WORK_DIR}/from_hf/final/model.safetensors ${WORK_DIR}/from_ckpt/final/model.safetensors --rtol 1e-5)
run(0 ${st_diff} ${WORK_DIR}/from_native/final/model.safetensors ${WORK_DIR}/from_ckpt/final/model.safetensors --rtol 1e-5)
# ... and not A's end: they trained on.
run(1 ${st_diff} ${WORK_DIR}/from_ckpt/final/model.safetensors ${WORK_DIR}/a/hf/model.safetensors)
# A pretrained start is step 0 of a new run: it does not resume A's step or optimizer.
file(READ ${WORK_DIR}/from_hf/summary.json summary)
expect_in("${summary}" "\"steps\": 6,")
# A run that resumes from its own checkpoint ignores init_from.
run(0 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${gpt} ${start} --set run.max_steps=8 --set data.batch_size=2 --set run.out_dir=${WORK_DIR}/from_hf
    --set checkpoint.init_from=${WORK_DIR}/a/hf)
expect_in("${last_output}" "resumed from [^\n]*step_00000006.h5 at step 6")
if(last_output MATCHES "initialized the model")
  message(FATAL_ERROR "a resumed run loaded checkpoint.init_from:\n${last_output}")
endif()

# 3. An untied LM head is GPT-2's lm_head.weight; the export reads back.
run(0 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${gpt} --set model.tie_embeddings=false --set run.max_steps=2 --set data.batch_size=2
    --set run.out_dir=${WORK_DIR}/untied --set checkpoint.export=hf --set checkpoint.export_names=hf-gpt2)
file(READ ${WORK_DIR}/untied/hf/model.safetensors head OFFSET 8 LIMIT 4000)
expect_in("${head}" "lm_head.weight\":{\"dtype\":\"F32\",\"shape\":\\[97,32\\]")
run(0 ${MPIEXEC} -np 4 ${TRAIN} ${DECK} ${gpt} --set model.tie_embeddings=false --set run.max_steps=1 --set data.batch_size=2
    --set run.out_dir=${WORK_DIR}/untied_back --set checkpoint.init_from=${WORK_DIR}/untied/hf)
# ... and a tied model would pass over that head: refused, naming config.json and the setting.
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.max_steps=1 --set data.batch_size=2 --set run.out_dir=${WORK_DIR}/untied_into_tied
    --set checkpoint.init_from=${WORK_DIR}/untied/hf)
expect_in("${last_output}" "checkpoint.init_from: [^\n]*untied/hf/config.json describes another model than the deck's:\n  tie_word_embeddings \\(model.tie_embeddings\\): false in the file, true by the deck\n")
expect_in("${last_output}" "model.hf_config = '[^']*untied/hf' builds the model it describes")
# ... also with checkpoint.init_allow_missing, which lets other sizes through with a warning.
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.max_steps=1 --set data.batch_size=2 --set run.out_dir=${WORK_DIR}/untied_into_tied2
    --set checkpoint.init_from=${WORK_DIR}/untied/hf --set checkpoint.init_allow_missing=true)
expect_in("${last_output}" "tie_word_embeddings \\(model.tie_embeddings\\): false in the file, true by the deck")

# 4. Bad pretrained files: every rank exits 2, the message names the tensor or file. With its
#    config.json, the keys that differ are named first; without one, the tensors.
run(2 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${gpt} --set model.d_model=48 --set run.out_dir=${WORK_DIR}/bad_config
    --set checkpoint.init_from=${WORK_DIR}/a/hf)
expect_in("${last_output}" "a/hf/config.json describes another model than the deck's:\n  n_embd \\(model.d_model\\): 32 in the file, 48 by the deck\n")
file(COPY ${WORK_DIR}/a/hf/model.safetensors DESTINATION ${WORK_DIR}/a_bare)
run(2 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${gpt} --set model.d_model=48 --set run.out_dir=${WORK_DIR}/bad_shape
    --set checkpoint.init_from=${WORK_DIR}/a_bare)
expect_in("${last_output}" "tensor 'transformer.wpe.weight': shape \\[16, 32\\] in the file, \\[16, 48\\] expected")
run(2 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${gpt} --set model.n_layers=3 --set run.out_dir=${WORK_DIR}/bad_missing
    --set checkpoint.init_from=${WORK_DIR}/a_bare)
expect_in("${last_output}" "parameter 'block2.attn.qkv.weight' is missing \\(as 'transformer.h.2.attn.c_attn.weight'\\)")
run(0 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${gpt} --set model.n_layers=3 --set run.max_steps=1 --set data.batch_size=2
    --set run.out_dir=${WORK_DIR}/allow_missing --set checkpoint.init_from=${WORK_DIR}/a/hf --set checkpoint.init_allow_missing=true)
expect_in("${last_output}" "checkpoint.init_from lacks 12 parameter\\(s\\), which keep their initialization: block2")
# ... which also lets the model differ from the config.json beside the weights: said, not refused.
expect_in("${last_output}" "warning: [^\n]*a/hf/config.json describes another model than the deck's \\(checkpoint.init_allow_missing = true\\):\n  n_layer \\(model.n_layers\\): 2 in the file, 3 by the deck")
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set model.n_layers=1 --set run.out_dir=${WORK_DIR}/bad_unexpected
    --set checkpoint.init_from=${WORK_DIR}/a_bare)
expect_in("${last_output}" "unexpected tensor 'transformer.h.1.attn.c_attn.bias'")
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.out_dir=${WORK_DIR}/bad_path --set checkpoint.init_from=${WORK_DIR}/nowhere)
expect_in("${last_output}" "nowhere")
file(WRITE ${WORK_DIR}/garbage.safetensors "not a safetensors file at all")
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${gpt} --set run.out_dir=${WORK_DIR}/bad_file --set checkpoint.init_from=${WORK_DIR}/garbage.safetensors)
expect_in("${last_output}" "garbage.safetensors")
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} --set model.kind=cnn --set data.kind=fashion-mnist --set run.out_dir=${WORK_DIR}/bad_kind
    --set checkpoint.export_names=hf-gpt2 --set checkpoint.export=hf)
expect_in("${last_output}" "checkpoint.export_names")
