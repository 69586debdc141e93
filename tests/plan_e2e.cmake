# fsdp-plan against fsdp-train (cmake -P script; registered in tests/CMakeLists.txt as plan_end_to_end).
#  1. The closed-form model of every family equals the model LibTorch builds (fsdp-train --check-plan).
#  2. The process baseline: the peak RSS of a run whose model and data are negligible, minus what the
#     plan predicts for them (reported next to the default, kDefaultBaselineMib in app/plan/measured.hpp).
#  3. For an MLP of 24M parameters, a GPT of 7M parameters and a Llama of 6.5M parameters (also with
#     activation checkpointing), FULL_SHARD and NO_SHARD at np 2 (torch
#     threads 1, 3 steps, no checkpoints): the predicted parameter count equals summary.json's "params",
#     the predicted params + grads + optimizer state equal fsdp-train's "expected ... MiB", the units,
#     shard elements and padding equal fsdp-train's echo, and every rank's peak_rss_mb is within 15% of
#     the predicted peak.
#  4. --memory: the largest n_layers reported fits and one more layer does not.
#  5. Bad decks: the same message and exit code 2 as fsdp-train.
# Variables: MPIEXEC (list), TRAIN (fsdp-train), PLAN (fsdp-plan), WORK_DIR.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
include(${CMAKE_CURRENT_LIST_DIR}/e2e_common.cmake)

set(tolerance_pct 15)
set(train2 ${MPIEXEC} -np 2 ${TRAIN})
set(train1 ${MPIEXEC} -np 1 ${TRAIN})
set(common --set run.threads=1 --set checkpoint.every_steps=0 --set checkpoint.save_final=false --set checkpoint.resume=none
           --set log.progress=plain)

# The decks: training state dominates memory.
file(WRITE ${WORK_DIR}/mlp.toml [=[
# MLP, 24,202,250 parameters (fc1, fc2, fc3 units under SIZE_BASED_WRAP), Adam, batch 64 per rank.
[run]
name = "plan_mlp"
max_steps = 3
[model]
kind = "mlp"
hidden_sizes = [4096, 4096, 1024]
[data]
kind = "fashion-mnist"
batch_size = 64
test_samples = 256
test_batch_size = 128
[optim]
kind = "adam"
lr = 1e-3
[fsdp]
auto_wrap_policy = "SIZE_BASED_WRAP"
]=])
file(WRITE ${WORK_DIR}/gpt.toml [=[
# GPT, 7,221,504 parameters (d_model 384, 4 blocks, each a unit), AdamW with weight decay, dropout 0.1,
# batch 8 x 64 tokens per rank.
[run]
name = "plan_gpt"
max_steps = 3
[model]
kind = "transformer"
vocab_size = 256
context = 64
d_model = 384
n_heads = 6
n_layers = 4
[data]
kind = "tokens"
num_samples = 512
batch_size = 8
test_samples = 16
test_batch_size = 8
[optim]
kind = "adamw"
lr = 1e-3
weight_decay = 0.1
[fsdp]
auto_wrap_policy = "TRANSFORMER_BASED_WRAP"
]=])
file(WRITE ${WORK_DIR}/llama.toml [=[
# Llama, 6,491,520 parameters (d_model 384, 6 heads, 2 KV heads, SwiGLU 1024, 4 layers, untied), AdamW,
# batch 8 x 128 tokens per rank.
[run]
name = "plan_llama"
max_steps = 3
[model]
kind = "llama"
vocab_size = 256
context = 128
d_model = 384
n_heads = 6
n_kv_heads = 2
n_layers = 4
intermediate_size = 1024
tie_embeddings = false
[data]
kind = "tokens"
num_samples = 512
batch_size = 8
test_samples = 16
test_batch_size = 8
[optim]
kind = "adamw"
lr = 1e-3
weight_decay = 0.1
[fsdp]
auto_wrap_policy = "TRANSFORMER_BASED_WRAP"
]=])
# The same with activation checkpointing at context 256, batch 16: the recomputed layers' activations.
file(READ ${WORK_DIR}/llama.toml llama_deck)
string(REPLACE "context = 128" "context = 256" llama_deck "${llama_deck}")
string(REPLACE "batch_size = 8\n" "batch_size = 16\n" llama_deck "${llama_deck}")
file(WRITE ${WORK_DIR}/llama_checkpointed.toml "${llama_deck}activation_checkpointing = true\n")
file(WRITE ${WORK_DIR}/tiny.toml [=[
# Next to nothing: its peak RSS is the process baseline.
[run]
name = "plan_tiny"
max_steps = 3
[model]
kind = "transformer"
vocab_size = 16
context = 8
d_model = 8
n_heads = 1
n_layers = 1
[data]
kind = "tokens"
num_samples = 64
batch_size = 2
test_batch_size = 2
[optim]
kind = "sgd"
lr = 0.1
]=])

# value_of(VAR TEXT REGEX): the first capture group of REGEX in TEXT, or a failure.
function(value_of var text pattern)
  if(NOT text MATCHES "${pattern}")
    message(FATAL_ERROR "expected '${pattern}' in:\n${text}")
  endif()
  set(${var} "${CMAKE_MATCH_1}" PARENT_SCOPE)
endfunction()

# MiB as an integer (CMake's math is integer only): "787.12" -> 787
function(whole var text)
  string(REGEX REPLACE "\\..*$" "" w "${text}")
  set(${var} "${w}" PARENT_SCOPE)
endfunction()

# 1. Closed forms against the built models.
foreach(variant "${WORK_DIR}/mlp.toml" "${WORK_DIR}/gpt.toml" "${WORK_DIR}/llama.toml" "${WORK_DIR}/gpt.toml;--set;model.tie_embeddings=false;--set;model.mlp_ratio=3"
                "${WORK_DIR}/mlp.toml;--set;model.kind=cnn" "${WORK_DIR}/mlp.toml;--set;model.hidden_sizes=[7]")
  run(0 ${TRAIN} ${variant} --check-plan)
  expect_in("${last_output}" "model check: the closed form matches the built model")
endforeach()

# 2. The baseline.
run(0 ${train2} ${WORK_DIR}/tiny.toml ${common} --set run.out_dir=${WORK_DIR}/tiny)
file(READ ${WORK_DIR}/tiny/summary.json summary)
string(JSON rss0 GET "${summary}" peak_rss_mb 0)
string(JSON rss1 GET "${summary}" peak_rss_mb 1)
run(0 ${PLAN} ${WORK_DIR}/tiny.toml --np 2 ${common} --baseline-mib 0)
value_of(tiny_model "${last_output}" "predicted peak RSS per rank: ([0-9.]+) MiB")
whole(r0 ${rss0})
whole(r1 ${rss1})
whole(m ${tiny_model})
if(r1 GREATER r0)
  set(r0 ${r1})
endif()
math(EXPR baseline "${r0} - ${m}")
file(STRINGS ${CMAKE_CURRENT_LIST_DIR}/../app/plan/measured.hpp default_line REGEX "kDefaultBaselineMib = ")
value_of(default_baseline "${default_line}" "kDefaultBaselineMib = ([0-9.]+)")
message(STATUS "process baseline measured: ${baseline} MiB (peak RSS ${rss0} / ${rss1} MiB minus ${tiny_model} MiB predicted for the "
               "tiny model and data); fsdp-plan's default: ${default_baseline} MiB")

# 3. Predicted against measured.
set(report "")
# A third field: run.malloc (the default reuse keeps every block on the heap; fsdp-plan models each policy).
# A fourth: fsdp.optimizer_sharding, with groups of one rank (two replicas); - for none.
# A fifth: optim.state_dtype (bf16: Adam's moments in 2 bytes, updated without temporaries).
foreach(case "mlp;FULL_SHARD" "mlp;NO_SHARD" "gpt;FULL_SHARD" "gpt;NO_SHARD" "mlp;FULL_SHARD;return" "gpt;NO_SHARD;return" "gpt;FULL_SHARD;untouched"
             "gpt;HYBRID_SHARD;reuse;world" "llama;FULL_SHARD" "llama;NO_SHARD" "llama_checkpointed;FULL_SHARD" "mlp;FULL_SHARD;return;-;bf16"
             "gpt;FULL_SHARD;reuse;-;bf16")
  list(GET case 0 deck)
  list(GET case 1 strategy)
  set(out ${WORK_DIR}/${deck}_${strategy})
  set(sets ${common} --set fsdp.sharding_strategy=${strategy})
  list(LENGTH case fields)
  if(fields GREATER 2)
    list(GET case 2 malloc)
    set(out ${out}_${malloc})
    list(APPEND sets --set run.malloc=${malloc})
    set(strategy "${strategy} (run.malloc = ${malloc})")
  endif()
  if(fields GREATER 4)
    list(GET case 4 state_dtype)
    set(out ${out}_${state_dtype})
    list(APPEND sets --set optim.state_dtype=${state_dtype})
    set(strategy "${strategy} (optim.state_dtype = ${state_dtype})")
  endif()
  set(optimizer_sharding "-")
  if(fields GREATER 3)
    list(GET case 3 optimizer_sharding)
  endif()
  if(NOT optimizer_sharding STREQUAL "-")
    set(out ${out}_${optimizer_sharding})
    list(APPEND sets --set fsdp.shard_group_size=1 --set fsdp.optimizer_sharding=${optimizer_sharding})
    set(strategy "${strategy} (fsdp.optimizer_sharding = ${optimizer_sharding})")
  endif()
  list(APPEND sets --set run.out_dir=${out})
  run(0 ${train2} ${WORK_DIR}/${deck}.toml ${sets})
  set(train_out "${last_output}")
  run(0 ${PLAN} ${WORK_DIR}/${deck}.toml --np 2 ${sets} --baseline-mib ${baseline})
  set(plan_out "${last_output}")
  message(STATUS "fsdp-plan:\n${plan_out}")

  file(READ ${out}/summary.json summary)
  string(JSON params GET "${summary}" params)
  value_of(planned_params "${plan_out}" "\n  parameters ([0-9]+)\n")
  if(NOT params STREQUAL planned_params)
    message(FATAL_ERROR "${deck} ${strategy}: summary.json params ${params}, fsdp-plan ${planned_params}")
  endif()
  set(state_re "expected ([0-9.]+) MiB of params \\+ grads \\+ optimizer state")
  value_of(state_train "${train_out}" "${state_re}")
  value_of(state_plan "${plan_out}" "${state_re}")
  if(NOT state_train STREQUAL state_plan)
    message(FATAL_ERROR "${deck} ${strategy}: fsdp-train expects ${state_train} MiB of state per rank, fsdp-plan ${state_plan} MiB")
  endif()
  set(shard_re "([0-9]+ shard elements \\([0-9]+ padding in all units\\))")
  value_of(shards_train "${train_out}" "${shard_re}")
  value_of(shards_plan "${plan_out}" "${shard_re}")
  value_of(units_train "${train_out}" "([0-9]+) unit\\(s\\), ")
  value_of(units_plan "${plan_out}" "([0-9]+) unit\\(s\\) under")
  if(NOT shards_train STREQUAL shards_plan OR NOT units_train STREQUAL units_plan)
    message(FATAL_ERROR "${deck} ${strategy}: fsdp-train: ${units_train} units, ${shards_train}; fsdp-plan: ${units_plan} units, ${shards_plan}")
  endif()
  # The allocator fsdp-train ran with and its policy are the ones fsdp-plan modelled.
  string(JSON allocator_train GET "${summary}" allocator)
  string(JSON malloc_train GET "${summary}" malloc)
  value_of(allocator_plan "${plan_out}" "allocator model \\(([a-z]+, run.malloc = [a-z]+)\\)")
  if(NOT "${allocator_train}, run.malloc = ${malloc_train}" STREQUAL allocator_plan)
    message(FATAL_ERROR "${deck} ${strategy}: fsdp-train ran ${allocator_train} with run.malloc = ${malloc_train}; fsdp-plan modelled ${allocator_plan}")
  endif()
  # ... and jemalloc ran with fsdp-train's settings (app/fsdp_train.cpp) and the policy's decay time.
  if(allocator_train STREQUAL "jemalloc")
    string(JSON oversize GET "${summary}" allocator_settings oversize_threshold)
    string(JSON decay GET "${summary}" allocator_settings dirty_decay_ms)
    set(want_decay -1)
    if(malloc_train STREQUAL "return")
      set(want_decay 0)
    endif()
    if(NOT oversize EQUAL 0 OR NOT decay EQUAL want_decay)
      message(FATAL_ERROR "${deck} ${strategy}: jemalloc ran with oversize_threshold ${oversize} and dirty_decay_ms ${decay}; "
                          "expected 0 and ${want_decay}")
    endif()
  endif()

  value_of(predicted "${plan_out}" "predicted peak RSS per rank: ([0-9.]+) MiB")
  whole(p ${predicted})
  string(JSON nranks LENGTH "${summary}" peak_rss_mb)
  math(EXPR last "${nranks} - 1")
  set(measured "")
  foreach(r RANGE ${last})
    string(JSON rss GET "${summary}" peak_rss_mb ${r})
    whole(m ${rss})
    list(APPEND measured ${m})
    math(EXPR diff "${m} - ${p}")
    if(diff LESS 0)
      math(EXPR diff "-(${diff})")
    endif()
    math(EXPR err_permille "1000 * ${diff} / ${p}")
    math(EXPR lhs "100 * ${diff}")
    math(EXPR rhs "${tolerance_pct} * ${p}")
    string(APPEND report "  ${deck} ${strategy} rank ${r}: predicted ${predicted} MiB, measured ${rss} MiB, |error| ${err_permille} per mille\n")
    if(lhs GREATER rhs)
      message(FATAL_ERROR "${deck} ${strategy} rank ${r}: measured peak RSS ${rss} MiB is not within ${tolerance_pct}% of the predicted ${predicted} MiB")
    endif()
  endforeach()
  message(STATUS "${deck} ${strategy}: params ${params}, state ${state_plan} MiB per rank, peak RSS measured ${measured} MiB, predicted ${predicted} MiB")
endforeach()
message(STATUS "predicted vs measured peak RSS per rank (baseline ${baseline} MiB):\n${report}")

# 4. --memory: the reported largest n_layers fits, one more does not (same baseline).
run(0 ${PLAN} ${WORK_DIR}/gpt.toml --np 2 --memory 1.5 --baseline-mib ${baseline})
string(FIND "${last_output}" "Largest model" at)
string(SUBSTRING "${last_output}" ${at} -1 largest)
value_of(layers "${largest}" "\n  FULL_SHARD +([0-9]+) ")
math(EXPR more "${layers} + 1")
run(0 ${PLAN} ${WORK_DIR}/gpt.toml --np 2 --baseline-mib ${baseline} --set model.n_layers=${layers})
value_of(at "${last_output}" "predicted peak RSS per rank: ([0-9.]+) MiB")
run(0 ${PLAN} ${WORK_DIR}/gpt.toml --np 2 --baseline-mib ${baseline} --set model.n_layers=${more})
value_of(above "${last_output}" "predicted peak RSS per rank: ([0-9.]+) MiB")
whole(a ${at})
whole(b ${above})
if(a GREATER 1536 OR b LESS 1536)
  message(FATAL_ERROR "--memory 1.5: n_layers ${layers} predicts ${at} MiB, ${more} predicts ${above} MiB (budget 1536 MiB)")
endif()
message(STATUS "--memory 1.5 GiB: FULL_SHARD fits n_layers ${layers} (${at} MiB), not ${more} (${above} MiB)")

# 4b. A deck that names only the block class on an untied GPT leaves the embeddings and the head in the
#     root unit, gathered for the whole step: fsdp-plan and fsdp-train's echo say so, with the bytes
#     and the setting that avoids it; "auto" makes them units and the note goes.
set(root_heavy --set model.tie_embeddings=false --set model.vocab_size=8192 --set fsdp.transformer_layer_cls_to_wrap=TransformerBlock)
# 8192 x 384 twice (6.3M of 13.4M parameters) in the root: 24.1 MiB gathered at fp32.
set(root_note "note: the root unit holds 47% of the parameters \\(head \\(LmHead\\), tok \\(Embedding\\)\\), gathered from the first forward to the end of backward: 24.1 MiB per rank besides its shard, and as much again for its gradient in backward; fsdp.transformer_layer_cls_to_wrap = \"auto\" \\(or adding Embedding, LmHead\\) makes them units of their own")
run(0 ${PLAN} ${WORK_DIR}/gpt.toml --np 2 ${root_heavy})
expect_in("${last_output}" "${root_note}")
string(REGEX MATCH "note: the root unit[^\n]*" plan_note "${last_output}")
run(0 ${train2} ${WORK_DIR}/gpt.toml ${common} ${root_heavy} --set run.out_dir=${WORK_DIR}/root_heavy --dry-run)
string(REGEX MATCH "note: the root unit[^\n]*" train_note "${last_output}")
if(NOT plan_note STREQUAL train_note)
  message(FATAL_ERROR "fsdp-train's echo says\n  ${train_note}\nfsdp-plan says\n  ${plan_note}")
endif()
run(0 ${PLAN} ${WORK_DIR}/gpt.toml --np 2 ${root_heavy} --set fsdp.transformer_layer_cls_to_wrap=auto)
expect_not_in("${last_output}" "note: the root unit")
# A wrapping key the chosen policy does not read: both say so, alike (the run goes on).
set(unused_wrap --set fsdp.auto_wrap_policy=NO_WRAP --set fsdp.transformer_layer_cls_to_wrap=Bogus)
run(0 ${PLAN} ${WORK_DIR}/gpt.toml --np 2 ${unused_wrap})
string(REGEX MATCH "warning: [^\n]*does not read it[^\n]*" plan_unused "${last_output}")
expect_in("${plan_unused}" "fsdp.transformer_layer_cls_to_wrap = \"Bogus\" is set, but fsdp.auto_wrap_policy = \"NO_WRAP\" does not read it \\(TRANSFORMER_BASED_WRAP does\\)")
run(0 ${train2} ${WORK_DIR}/gpt.toml ${common} ${unused_wrap} --set run.out_dir=${WORK_DIR}/unused_wrap --dry-run)
string(REGEX MATCH "warning: [^\n]*does not read it[^\n]*" train_unused "${last_output}")
if(NOT plan_unused STREQUAL train_unused)
  message(FATAL_ERROR "fsdp-train's echo says\n  ${train_unused}\nfsdp-plan says\n  ${plan_unused}")
endif()

# 5. Bad decks: fsdp-plan says what fsdp-train says, with exit code 2.
file(WRITE ${WORK_DIR}/bad.toml "[run]\nname = \"bad\"\n\n[optim]\nlrr = 0.1\n[data]\nbatch_size = -4\n")
foreach(bad "${WORK_DIR}/bad.toml" "${WORK_DIR}/missing.toml" "${WORK_DIR}/gpt.toml;--set;data.kind=mnist"
            "${WORK_DIR}/gpt.toml;--set;fsdp.transformer_layer_cls_to_wrap=Blok"
            "${WORK_DIR}/gpt.toml;--set;fsdp.sharding_strategy=HYBRID_SHARD;--set;fsdp.shard_group_size=3"
            "${WORK_DIR}/gpt.toml;--set;fsdp.shard_group_size=2" "${WORK_DIR}/gpt.toml;--set;fsdp.transformer_layer_cls_to_wrap="
            "${WORK_DIR}/mlp.toml;--set;fsdp.auto_wrap_policy=TRANSFORMER_BASED_WRAP"
            "${WORK_DIR}/gpt.toml;--set;fsdp.mixed_precision=fp16;--set;fsdp.backend=mpi")
  run(2 ${train1} ${bad} --dry-run --set run.out_dir=${WORK_DIR}/bad_run)
  value_of(train_error "${last_output}" "fsdp-train: error: ([^\n]*)")
  run(2 ${PLAN} ${bad} --np 1)
  value_of(plan_error "${last_output}" "fsdp-plan: error: ([^\n]*)")
  if(NOT train_error STREQUAL plan_error)
    message(FATAL_ERROR "different errors for ${bad}:\n  fsdp-train: ${train_error}\n  fsdp-plan:  ${plan_error}")
  endif()
endforeach()
# ... each named: a wrapping with no type to wrap, fp16 on the CPU that fsdp.backend = "mpi" asks for.
run(2 ${PLAN} ${WORK_DIR}/gpt.toml --np 2 --set fsdp.transformer_layer_cls_to_wrap=)
expect_in("${last_output}" "--set fsdp.transformer_layer_cls_to_wrap=: fsdp.transformer_layer_cls_to_wrap: names no module type: TRANSFORMER_BASED_WRAP wraps the module types named here")
run(2 ${PLAN} ${WORK_DIR}/mlp.toml --np 2 --set fsdp.auto_wrap_policy=TRANSFORMER_BASED_WRAP)
expect_in("${last_output}" "fsdp.transformer_layer_cls_to_wrap: \"auto\" names no layer for model.kind = \"mlp\"")
run(2 ${PLAN} ${WORK_DIR}/gpt.toml --np 2 --set fsdp.mixed_precision=fp16 --set fsdp.backend=mpi)
expect_in("${last_output}" "fsdp.mixed_precision: fp16 computes in half precision")
run(2 ${PLAN} ${WORK_DIR}/bad.toml --np 2)
expect_in("${last_output}" "bad.toml:5: optim.lrr: unknown key \\(did you mean optim.lr\\?\\)")
expect_in("${last_output}" "bad.toml:7: data.batch_size: -4 is below the minimum 1")
run(2 ${PLAN} ${WORK_DIR} --np 2)  # a folder as the deck: read as an empty deck, it would plan the default job
expect_in("${last_output}" "cannot read deck '[^']*': it is a folder, not a file")
# Bad flags: NaN (which CLI11's ranges let through), a budget past what the byte counts hold, more
# ranks per node than ranks.
foreach(flag "--memory;nan" "--baseline-mib;nan" "--heap-factor;nan")
  run(2 ${PLAN} ${WORK_DIR}/gpt.toml --np 2 ${flag})
  list(GET flag 0 name)
  expect_in("${last_output}" "fsdp-plan: error: ${name}: 'nan' is not a number")
endforeach()
run(2 ${PLAN} ${WORK_DIR}/gpt.toml --np 2 --memory 1e10)
expect_in("${last_output}" "--memory: 1e\\+10 GiB per rank is more than the 1.04858e\\+06 GiB this plan counts")
run(2 ${PLAN} ${WORK_DIR}/gpt.toml --np 4 --ranks-per-node 100)
expect_in("${last_output}" "--ranks-per-node 100 is more than the 4 rank\\(s\\) of --np")
# A search that reaches the deck's own maximum of a key says so (">="), never a value the deck refuses.
run(0 ${PLAN} ${WORK_DIR}/gpt.toml --np 2 --memory 100000)
expect_in("${last_output}" ">=100000")
message(STATUS "all fsdp-plan cases passed")
