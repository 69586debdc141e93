# Continuing a run on fewer or more ranks (docs/reliability.md): with data.global_batch_size fixed, a run
# stopped at 4 ranks and resumed at 2 (and 2 -> 3, 3 -> 4) ends with the weights of the uninterrupted run
# within 1e-5 (and so do optim.accum_reduce = every, fsdp.reshard_after_forward = 2 and fsdp.optimizer_sharding
# = world); without it, a resume whose global batch differs stops with exit 2 naming the key.
# Variables: MPIEXEC (list), TRAIN, CKPT_TOOL, DECK (inputs/gpt_tokens.toml), WORK_DIR.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
include(${CMAKE_CURRENT_LIST_DIR}/e2e_common.cmake)

# A small GPT, dropout 0; SGD with momentum and a constant rate so that every tensor can be held to 1e-5
# (Adam's g/sqrt(v) amplifies the summation-order rounding of near-zero gradients). 240 samples: every
# step's global batch of 12 is full at any world size. Micro-batches of at most 2 samples: 4 ranks take
# 3 micro-batches of 1, 3 ranks 2 of 2, 2 ranks 3 of 2.
set(common --set model.vocab_size=64 --set model.d_model=32 --set model.n_layers=2 --set model.context=16 --set model.dropout=0
           --set data.num_samples=240 --set data.batch_size=2 --set data.global_batch_size=12 --set optim.kind=sgd --set optim.lr=0.05
           --set optim.momentum=0.9 --set optim.weight_decay=0 --set optim.schedule=constant --set optim.warmup_steps=0
           --set checkpoint.every_steps=4 --set log.progress=plain --set run.threads=1)

run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${common} --set run.max_steps=8 --set run.out_dir=${WORK_DIR}/whole)
expect_in("${last_output}" "global batch 12 = 2 per rank x 2 ranks x 3 micro-batches")

foreach(pair "4;2" "2;3" "3;4")
  list(GET pair 0 before)
  list(GET pair 1 after)
  set(dir ${WORK_DIR}/from${before}to${after})
  run(0 ${MPIEXEC} -np ${before} ${TRAIN} ${DECK} ${common} --set run.max_steps=4 --set run.out_dir=${dir})
  run(0 ${MPIEXEC} -np ${after} ${TRAIN} ${DECK} ${common} --set run.max_steps=8 --set run.out_dir=${dir})
  expect_in("${last_output}" "resumed from [^\n]*step_00000004.h5 at step 4")
  run(0 ${CKPT_TOOL} diff ${dir}/checkpoints ${WORK_DIR}/whole/checkpoints --rtol 1e-5)
endforeach()
# Under a fixed global batch data.batch_size only bounds the micro-batches: a resume with smaller ones
# (to fit memory) is the same training, not a changed deck.
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${common} --set run.max_steps=4 --set run.out_dir=${WORK_DIR}/smaller_micro)
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${common} --set run.max_steps=8 --set data.batch_size=1 --set run.out_dir=${WORK_DIR}/smaller_micro)
expect_in("${last_output}" "resumed from [^\n]*step_00000004.h5 at step 4")
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/smaller_micro/checkpoints ${WORK_DIR}/whole/checkpoints --rtol 1e-5)
# 250 samples: an epoch is 20 whole global batches of 12 at every world size (the last 10 samples are
# not trained; no rank's padding enters a step), so 1 and 3 ranks take the same steps of the same samples.
foreach(np 1 3)
  run(0 ${MPIEXEC} -np ${np} ${TRAIN} ${DECK} ${common} --set data.num_samples=250 --set run.max_steps=0 --set run.epochs=1
      --set checkpoint.every_steps=0 --set run.out_dir=${WORK_DIR}/uneven${np})
  expect_in("${last_output}" "step 20/20")
endforeach()
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/uneven3/checkpoints ${WORK_DIR}/uneven1/checkpoints --rtol 1e-5)

# optim.accum_reduce = every (a reduction after each micro-batch, summed into the shards) equals the
# reduction after the last micro-batch within 1e-5, at every world size and for the unsharded and hybrid
# strategies too: same global batch, only the order of additions differs.
foreach(case "1;FULL_SHARD;0" "2;FULL_SHARD;0" "3;NO_SHARD;0" "4;HYBRID_SHARD;2")
  list(GET case 0 np)
  list(GET case 1 strategy)
  list(GET case 2 group)
  set(dir ${WORK_DIR}/every${np}${strategy})
  run(0 ${MPIEXEC} -np ${np} ${TRAIN} ${DECK} ${common} --set run.max_steps=8 --set optim.accum_reduce=every
      --set fsdp.sharding_strategy=${strategy} --set fsdp.shard_group_size=${group} --set run.out_dir=${dir})
  run(0 ${CKPT_TOOL} diff ${dir}/checkpoints ${WORK_DIR}/whole/checkpoints --rtol 1e-5)
endforeach()
# At 2 ranks both runs take 3 micro-batches per step: `every` reduce-scatters 3 times the bytes.
file(READ ${WORK_DIR}/whole/summary.json whole_summary)
file(READ ${WORK_DIR}/every2FULL_SHARD/summary.json every_summary)
string(JSON last_bytes GET "${whole_summary}" comm reduce_scatter bytes)
string(JSON every_bytes GET "${every_summary}" comm reduce_scatter bytes)
math(EXPR expected_bytes "3 * ${last_bytes}")
if(NOT every_bytes EQUAL expected_bytes OR last_bytes EQUAL 0)
  message(FATAL_ERROR "optim.accum_reduce = every reduce-scattered ${every_bytes} bytes, last ${last_bytes}: expected 3 times as many")
endif()

# fsdp.reshard_after_forward = 2 at 4 ranks (FULL_SHARD): each rank keeps half of a unit after forward and
# backward all-gathers inside pairs of ranks; the weights are those of the whole run within 1e-5, and
# summary.json splits a step's all-gathered bytes into those inside the pairs and those across the shard group.
run(0 ${MPIEXEC} -np 4 ${TRAIN} ${DECK} ${common} --set run.max_steps=8 --set fsdp.reshard_after_forward=2 --set run.out_dir=${WORK_DIR}/kept2)
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/kept2/checkpoints ${WORK_DIR}/whole/checkpoints --rtol 1e-5)
file(READ ${WORK_DIR}/kept2/summary.json kept_summary)
string(JSON kept_size GET "${kept_summary}" comm reshard_group size)
string(JSON inside GET "${kept_summary}" comm reshard_group all_gather_bytes_per_step_inside_group)
string(JSON across GET "${kept_summary}" comm reshard_group all_gather_bytes_per_step_across_shard_group)
if(NOT kept_size EQUAL 2 OR inside EQUAL 0 OR across EQUAL 0)
  message(FATAL_ERROR "summary.json comm.reshard_group: size ${kept_size}, ${inside} bytes inside the pairs, ${across} across: expected 2 and both > 0")
endif()
# A group that does not divide the shard group into smaller ones is a deck error naming the key: 3 ranks
# have none, and at 4 ranks on one node "node" is the whole shard group.
run(2 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${common} --set fsdp.reshard_after_forward=2 --set run.out_dir=${WORK_DIR}/kept_bad3 --dry-run)
expect_in("${last_output}" "fsdp.reshard_after_forward: 2 does not divide the shard group of 3 rank\\(s\\) into smaller groups")
run(2 ${MPIEXEC} -np 4 ${TRAIN} ${DECK} ${common} --set fsdp.reshard_after_forward=node --set run.out_dir=${WORK_DIR}/kept_node --dry-run)
expect_in("${last_output}" "fsdp.reshard_after_forward: node \\(4 ranks\\): 4 does not divide")

# fsdp.optimizer_sharding = world (HFSDP): the optimizer state over every rank, parameters inside the
# groups. The weights are those of the whole run within 1e-5; a run stopped at 4 ranks (groups of 2, 2
# replicas) resumes at 3 (groups of 1, 3 replicas) and at 2 with FULL_SHARD; per rank the expected
# training state shrinks (fp32 gradients and SGD's momentum over 4 ranks instead of 2).
run(0 ${MPIEXEC} -np 4 ${TRAIN} ${DECK} ${common} --set run.max_steps=8 --set fsdp.sharding_strategy=HYBRID_SHARD --set fsdp.shard_group_size=2
    --set run.out_dir=${WORK_DIR}/hybrid_group)
string(REGEX MATCH "expected ([0-9.]+) MiB" _ "${last_output}")
set(group_mib ${CMAKE_MATCH_1})
set(dir ${WORK_DIR}/hybrid_world)
run(0 ${MPIEXEC} -np 4 ${TRAIN} ${DECK} ${common} --set run.max_steps=4 --set fsdp.sharding_strategy=HYBRID_SHARD --set fsdp.shard_group_size=2
    --set fsdp.optimizer_sharding=world --set run.out_dir=${dir})
string(REGEX MATCH "expected ([0-9.]+) MiB" _ "${last_output}")
set(world_mib ${CMAKE_MATCH_1})
if(NOT world_mib LESS group_mib)
  message(FATAL_ERROR "fsdp.optimizer_sharding = world expects ${world_mib} MiB of training state per rank, group ${group_mib}: expected less")
endif()
file(READ ${dir}/summary.json world_summary)
string(JSON sharding GET "${world_summary}" optimizer_sharding)
if(NOT sharding STREQUAL "world")
  message(FATAL_ERROR "summary.json optimizer_sharding is '${sharding}', expected world")
endif()
run(0 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${common} --set run.max_steps=8 --set fsdp.sharding_strategy=HYBRID_SHARD --set fsdp.shard_group_size=1
    --set fsdp.optimizer_sharding=world --set run.out_dir=${dir})
expect_in("${last_output}" "resumed from [^\n]*step_00000004.h5 at step 4")
run(0 ${CKPT_TOOL} diff ${dir}/checkpoints ${WORK_DIR}/whole/checkpoints --rtol 1e-5)
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${common} --set run.max_steps=8 --set checkpoint.resume=${dir}/checkpoints/step_00000004.h5
    --set run.out_dir=${WORK_DIR}/world_to_full)
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/world_to_full/checkpoints/step_00000008.h5 ${WORK_DIR}/whole/checkpoints/step_00000008.h5 --rtol 1e-5)
# Where it means nothing it is a deck error naming the key.
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${common} --set fsdp.optimizer_sharding=world --set run.out_dir=${WORK_DIR}/world_bad --dry-run)
expect_in("${last_output}" "fsdp.optimizer_sharding[^\n]*applies to the hybrid strategies")

# Without a fixed global batch, 2 ranks x 6 become 3 ranks x 6 = 18: the resume stops, naming both global batches and the key.
set(plain --set model.vocab_size=64 --set model.d_model=32 --set model.n_layers=2 --set model.context=16 --set model.dropout=0
          --set data.num_samples=240 --set data.batch_size=6 --set log.progress=plain --set run.threads=1 --set checkpoint.every_steps=2)
run(0 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${plain} --set run.max_steps=2 --set run.out_dir=${WORK_DIR}/changed)
run(2 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${plain} --set run.max_steps=6 --set run.out_dir=${WORK_DIR}/changed)
expect_in("${last_output}" "trained with global batches of 12 samples, this run's are 18 \\(data.batch_size 6 x 3 ranks x optim.grad_accum_steps 1\\): set data.global_batch_size = 12")
# A global batch that does not divide over the ranks, or with grad_accum_steps set too, is a deck error.
run(2 ${MPIEXEC} -np 3 ${TRAIN} ${DECK} ${plain} --set data.global_batch_size=8 --set run.out_dir=${WORK_DIR}/bad1 --dry-run)
expect_in("${last_output}" "data.global_batch_size: 8 samples do not divide over 3 ranks")
run(2 ${MPIEXEC} -np 2 ${TRAIN} ${DECK} ${plain} --set data.global_batch_size=8 --set optim.grad_accum_steps=2 --set run.out_dir=${WORK_DIR}/bad2 --dry-run)
expect_in("${last_output}" "optim.grad_accum_steps: is derived from data.global_batch_size")
