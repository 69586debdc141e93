# fsdp-train end to end under mpirun: a smoke run of the CI deck, np=2 with batch b equals np=1 with
# batch 2b, a resumed run equals an uninterrupted one bit for bit, the echoed deck re-runs the same
# job, and bad input ends every rank with exit code 2 and a message naming the file and line.
# Variables: MPIEXEC (list), TRAIN, CKPT_TOOL, DECK (inputs/ci_tiny.toml), WORK_DIR, PLOT (fsdp-plot).
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

include(${CMAKE_CURRENT_LIST_DIR}/e2e_common.cmake)

set(train2 ${MPIEXEC} -np 2 ${TRAIN})
set(train1 ${MPIEXEC} -np 1 ${TRAIN})

# 1. Smoke: trains, evaluates, writes metrics.csv, summary.json, deck.toml and checkpoints.
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/smoke)
expect_in("${last_output}" "test accuracy [0-9.]+%")
expect_in("${last_output}" "world size 2 on 1 node\\(s\\), 2 rank\\(s\\) per node")
foreach(f deck.toml metrics.csv summary.json checkpoints/latest)
  if(NOT EXISTS ${WORK_DIR}/smoke/${f})
    message(FATAL_ERROR "missing ${WORK_DIR}/smoke/${f}")
  endif()
endforeach()
file(READ ${WORK_DIR}/smoke/summary.json summary)
foreach(key world_size nodes params steps final_train_loss test_loss test_accuracy wall_s step_ms_median samples_per_s peak_rss_mb phases
        model_flops_per_sample model_flops_per_s peak_flops_per_s gemm_probe)
  expect_in("${summary}" "\"${key}\": ")
endforeach()
expect_in("${summary}" "\"steps\": 24,")
# The model FLOP utilization: a GEMM probe on one thread at the model's products, kept in the run
# directory; the median step after 3 warm-up steps, whose times are reported apart.
expect_in("${summary}" "\"timing_warmup_steps\": 3,\n  \"step_ms_warmup\": \\[\n    [0-9.]+,\n    [0-9.]+,\n    [0-9.]+\n  \\]")
expect_in("${summary}" "\"mfu\": [0-9][0-9.e-]*,")
expect_in("${summary}" "\"cached\": false")
expect_in("${last_output}" "GEMM probe \\(measured, kept in gemm_probe_[^ ]+\\.json\\): [0-9.]+ GFLOP/s per thread at the model's products")
expect_in("${last_output}" "step 24/24 [^\n]* samples/s  MFU [0-9.]+%")
expect_in("${last_output}" "24 steps, median step [0-9.]+ ms \\(after 3 warm-up\\), MFU [0-9.]+%")
file(GLOB probes ${WORK_DIR}/smoke/gemm_probe_*.json)
if(NOT probes)
  message(FATAL_ERROR "no gemm_probe_<host>.json in ${WORK_DIR}/smoke")
endif()
file(STRINGS ${WORK_DIR}/smoke/metrics.csv rows)
list(LENGTH rows nrows)
if(NOT nrows EQUAL 7)
  message(FATAL_ERROR "metrics.csv has ${nrows} lines, expected a header and 6 rows")
endif()

# 2. Equivalence: 2 ranks x batch 32 == 1 rank x batch 64 (dropout 0), fp32 relative error <= 1e-5.
#    SGD with momentum: Adam-type updates g/sqrt(v) turn the summation-order rounding of near-zero
#    gradients into relative differences of ~1e-5 (the engine tests cover Adam with a larger eps).
set(common --set checkpoint.every_steps=0 --set checkpoint.resume=none --set run.max_steps=12
           --set optim.kind=sgd --set optim.lr=0.05 --set optim.momentum=0.9)
run(0 ${train2} ${DECK} ${common} --set data.batch_size=32 --set run.out_dir=${WORK_DIR}/np2)
run(0 ${train1} ${DECK} ${common} --set data.batch_size=64 --set run.out_dir=${WORK_DIR}/np1)
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/np2/checkpoints ${WORK_DIR}/np1/checkpoints --rtol 1e-5)
expect_in("${last_output}" "/model/fc1.weight")

# 2b. Evaluation of the image models every 8 steps on at most 1 batch (of 256 per rank): on the
#    progress and in metrics.csv, no perplexity; the weights equal those of the run without it.
run(0 ${train2} ${DECK} ${common} --set data.batch_size=32 --set run.out_dir=${WORK_DIR}/np2_eval --set eval.every_steps=8
    --set eval.max_batches=1)
expect_in("${last_output}" "epoch 1 step 8: test loss [0-9.]+, accuracy [0-9.]+% \\(512 samples\\)")
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/np2_eval/checkpoints ${WORK_DIR}/np2/checkpoints)
file(STRINGS ${WORK_DIR}/np2_eval/metrics.csv rows)
expect_in("${rows}" ";8,1,[0-9.]+,[^;]*,[0-9.]+,,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+,[0-9.e+-]+,[0-9]+,,0,[0-9.]+,[01],[0-9.e+-]+,,[0-9][0-9.e-]*;")  # its breakdown: forward .. minor_faults; no loss scale, nothing skipped; RSS, slowest rank; no tokens; MFU

# 3. Resume: 12 steps, then a second run continues to 24; bit-identical to the smoke run's step 24.
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/resume --set run.max_steps=12)
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/resume)
expect_in("${last_output}" "resumed from [^\n]*step_00000012.h5 at step 12")
expect_in("${last_output}" "GEMM probe \\(kept in gemm_probe_")  # measured by the first start
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/resume/checkpoints ${WORK_DIR}/smoke/checkpoints)
expect_in("${last_output}" "checkpoints match")

# 4. The resolved deck re-runs the same job (and re-resolves to itself).
run(0 ${train2} ${WORK_DIR}/smoke/deck.toml --set run.out_dir=${WORK_DIR}/echo)
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/echo/checkpoints ${WORK_DIR}/smoke/checkpoints)
run(0 ${train1} ${WORK_DIR}/echo/deck.toml --dry-run --set run.out_dir=${WORK_DIR}/echo2)
expect_in("${last_output}" "dry run")
file(STRINGS ${WORK_DIR}/echo/deck.toml a REGEX "^[^#]")   # values, not the provenance comments
file(STRINGS ${WORK_DIR}/echo2/deck.toml b REGEX "^[^#]")
string(REPLACE "${WORK_DIR}/echo2" "${WORK_DIR}/echo" b "${b}")
if(NOT a STREQUAL b)
  message(FATAL_ERROR "re-resolving deck.toml changed it:\n${a}\n----\n${b}")
endif()

# 5. Bad input: every rank exits 2, rank 0 names the file, line and key; nothing hangs.
file(WRITE ${WORK_DIR}/bad.toml "[run]\nname = \"bad\"\n\n[optim]\nlrr = 0.1\n[data]\nbatch_size = -4\n")
run(2 ${train2} ${WORK_DIR}/bad.toml)
expect_in("${last_output}" "bad.toml:5: optim.lrr: unknown key \\(did you mean optim.lr\\?\\)")
expect_in("${last_output}" "bad.toml:7: data.batch_size")
run(2 ${train2} ${DECK} --set data.path=${WORK_DIR}/nowhere --set run.out_dir=${WORK_DIR}/nodata)
expect_in("${last_output}" "nowhere")
run(2 ${train2} ${WORK_DIR}/missing.toml)
expect_in("${last_output}" "missing.toml")
run(2 ${train2} ${DECK} --set fsdp.backward_prefetch=SOMETIMES)
expect_in("${last_output}" "fsdp.backward_prefetch")
# A folder given as the deck (runs/a for runs/a/deck.toml) would read as an empty deck: the default job.
run(2 ${train2} ${WORK_DIR}/smoke --set run.out_dir=${WORK_DIR}/folder_deck)
expect_in("${last_output}" "cannot read deck '[^']*smoke': it is a folder, not a file")
if(EXISTS ${WORK_DIR}/folder_deck)
  message(FATAL_ERROR "a folder given as the deck started a run in ${WORK_DIR}/folder_deck")
endif()
# fsdp-ckpt: a bad command line is bad input (exit 2), as in the other tools.
run(2 ${CKPT_TOOL} verify)
run(2 ${CKPT_TOOL} verify ${WORK_DIR}/smoke/checkpoints --bogus)
run(2 ${CKPT_TOOL} diff ${WORK_DIR}/smoke/checkpoints ${WORK_DIR}/smoke/checkpoints --atol -1)
expect_in("${last_output}" "'-1' is not a number >= 0")
run(2 ${CKPT_TOOL} bogus ${WORK_DIR}/smoke/checkpoints)
expect_in("${last_output}" "fsdp-ckpt: unknown command 'bogus' \\(inspect, verify, merge, diff, export; --help for more\\)")
# A run directory or the `latest` file given as a checkpoint is named as what it is.
run(2 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/from_run --set checkpoint.init_from=${WORK_DIR}/smoke)
expect_in("${last_output}" "checkpoint.init_from: '[^']*smoke' is a run directory, not a checkpoint; its checkpoints are in '[^']*smoke/checkpoints'")
run(2 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/from_latest --set checkpoint.resume=${WORK_DIR}/smoke/checkpoints/latest)
expect_in("${last_output}" "checkpoint.resume: '[^']*latest' is the pointer file `latest`, not a checkpoint")

# 5b. A damaged `latest` and a truncated newest checkpoint: --eval-only falls back to the newest
#     checkpoint that loads, as a resume does, warning about each, and moves nothing (a resume would set
#     the unreadable newer one aside); with none loading it lists why (exit 2). fsdp-ckpt given the
#     folder names `latest` and the checkpoints there.
file(MAKE_DIRECTORY ${WORK_DIR}/damaged)
file(COPY ${WORK_DIR}/smoke/checkpoints DESTINATION ${WORK_DIR}/damaged)
file(WRITE ${WORK_DIR}/damaged/checkpoints/latest "garbage\n")
file(WRITE ${WORK_DIR}/damaged/checkpoints/step_00000024.h5 "truncated")
file(GLOB damaged_before RELATIVE ${WORK_DIR}/damaged/checkpoints ${WORK_DIR}/damaged/checkpoints/*)
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/damaged --eval-only)
expect_in("${last_output}" "warning: skipped checkpoint latest: holds 'garbage', not a checkpoint name; trying every checkpoint, newest first")
expect_in("${last_output}" "warning: skipped checkpoint step_00000024.h5: cannot open checkpoint file")
expect_in("${last_output}" "eval-only: [^\n]*damaged/checkpoints/step_00000016\\.h5 \\(step 16\\)")
file(GLOB damaged_after RELATIVE ${WORK_DIR}/damaged/checkpoints ${WORK_DIR}/damaged/checkpoints/*)
if(NOT damaged_before STREQUAL damaged_after)
  message(FATAL_ERROR "--eval-only changed the checkpoint folder: ${damaged_before} -> ${damaged_after}")
endif()
run(2 ${CKPT_TOOL} verify ${WORK_DIR}/damaged/checkpoints)
expect_in("${last_output}" "latest' holds 'garbage', not a checkpoint name: it names no checkpoint to read; name one of the checkpoints there instead \\(newest first: step_00000024\\.h5, step_00000016\\.h5")
file(WRITE ${WORK_DIR}/damaged/checkpoints/step_00000016.h5 "truncated")
run(2 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/damaged --eval-only)
expect_in("${last_output}" "none of the 2 checkpoint\\(s\\) in '[^']*damaged/checkpoints' can be loaded:")

# 6. A rerun of a finished job trains nothing and keeps its summary; a deck of another model in the
#    same folder is refused instead of silently starting a second run there.
file(READ ${WORK_DIR}/smoke/summary.json before)
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/smoke)
expect_in("${last_output}" "nothing to train: the run in [^\n]* already reached step 24 of 24")
file(READ ${WORK_DIR}/smoke/summary.json after)
if(NOT before STREQUAL after)
  message(FATAL_ERROR "a rerun of a finished job changed its summary.json")
endif()
# ... and finishes what the run's end did not write (a full disk, a killed job): the export and
#    summary.json, from the last checkpoint, saying so; a second rerun finds them all there.
file(REMOVE ${WORK_DIR}/smoke/summary.json)
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/smoke --set checkpoint.export=model.safetensors)
expect_in("${last_output}" "already reached step 24 of 24; wrote the missing export [^\n]*model.safetensors; wrote the missing summary.json")
foreach(f summary.json model.safetensors)
  if(NOT EXISTS ${WORK_DIR}/smoke/${f})
    message(FATAL_ERROR "the rerun of a finished job did not write ${WORK_DIR}/smoke/${f}")
  endif()
endforeach()
file(READ ${WORK_DIR}/smoke/summary.json rewritten)
expect_in("${rewritten}" "\"steps\": 24,")
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/smoke --set checkpoint.export=model.safetensors)
expect_in("${last_output}" "already reached step 24 of 24; its outputs are all there")
# A summary.json that --eval-only wrote in its place holds no training figures: still missing.
file(REMOVE ${WORK_DIR}/smoke/summary.json)
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/smoke --eval-only)
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/smoke --set checkpoint.export=model.safetensors)
expect_in("${last_output}" "already reached step 24 of 24; wrote the missing summary.json")
file(READ ${WORK_DIR}/smoke/summary.json rewritten)
expect_in("${rewritten}" "\"steps\": 24,")
# ... marked as written again, with the last step's losses from metrics.csv and --eval-only's figures kept.
expect_in("${rewritten}" "\"rewritten_by_rerun\": true")
expect_in("${rewritten}" "\"final_train_loss\": [0-9]")
expect_in("${rewritten}" "\"test_loss\": [0-9]")
expect_in("${rewritten}" "\"eval_only\": {")
# ... and writes the export again when the deck changed its settings (its type here); then it is there.
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/smoke --set checkpoint.export=model.safetensors --set checkpoint.export_dtype=bf16)
expect_in("${last_output}" "already reached step 24 of 24; wrote the export [^\n]*model.safetensors again \\(checkpoint.export_dtype: \"auto\" -> \"bf16\"\\)")
file(READ ${WORK_DIR}/smoke/model.safetensors exported_header OFFSET 8 LIMIT 700)  # inside the JSON header
expect_in("${exported_header}" "\"dtype\":\"BF16\"")
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/smoke --set checkpoint.export=model.safetensors --set checkpoint.export_dtype=bf16)
expect_in("${last_output}" "already reached step 24 of 24; its outputs are all there")
run(2 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/smoke --set run.max_steps=40 --set model.hidden_sizes=[48])
expect_in("${last_output}" "checkpoint.resume = \"auto\": '[^']*step_00000024.h5' holds another model than the deck's\n  model.hidden_sizes: \\[64, 32\\] in the file, \\[48\\] in the deck\n")
expect_in("${last_output}" "holds another run")

# 6b. A resume with a deck that changed keys deciding the training is refused, naming each key with
#     both values; checkpoint.resume_changed = "allow" goes on and lists them in summary.json; keys that
#     do not decide the training (logging, max_steps) change freely.
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/changed --set run.max_steps=8)
run(2 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/changed --set run.max_steps=16 --set optim.lr=0.002 --set data.shuffle=false)
expect_in("${last_output}" "was trained with another deck; these keys decide the training:\n  data.shuffle: true in the checkpoint, false now\n  optim.lr: 0.001 in the checkpoint, 0.002 now")
expect_not_in("${last_output}" "resumed from")  # a refused resume does not say it resumed
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/changed --set run.max_steps=12 --set log.every_steps=2)
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/changed --set run.max_steps=16 --set optim.lr=0.002 --set checkpoint.resume_changed=allow)
expect_in("${last_output}" "warning: resuming [^\n]* with changed keys \\(checkpoint.resume_changed = \"allow\"\\):\n  optim.lr: 0.001 in the checkpoint, 0.002 now")
file(READ ${WORK_DIR}/changed/summary.json changed)
expect_in("${changed}" "\"resume_changed\": \\[\n *\"optim.lr: 0.001 -> 0.002\"")

# A checkpoint.dir that is the run folder itself: the run's own lock, not another run's.
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/self_ckpt --set checkpoint.dir=. --set run.max_steps=8)
expect_in("${last_output}" "self_ckpt/\\./step_00000008.h5|self_ckpt/step_00000008.h5")

# 7. Nested units inside the GPT's blocks (every child is called through fsdp::forward).
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/gpt --set model.kind=transformer --set data.kind=tokens
    --set data.num_samples=256 --set model.d_model=32 --set model.n_layers=2 --set model.context=16 --set run.max_steps=6
    --set fsdp.auto_wrap_policy=TRANSFORMER_BASED_WRAP "--set=fsdp.transformer_layer_cls_to_wrap=TransformerBlock, CausalSelfAttention")
expect_in("${last_output}" "5 unit\\(s\\)")
run(2 ${train2} ${DECK} --set fsdp.auto_wrap_policy=TRANSFORMER_BASED_WRAP --set fsdp.transformer_layer_cls_to_wrap=Foo)
expect_in("${last_output}" "no module of type \"Foo\"")
# bf16 weights (an export in bf16) load into the fp32 model: said once, with how many were widened.
run(0 ${CKPT_TOOL} export ${WORK_DIR}/gpt/checkpoints ${WORK_DIR}/gpt_bf16.safetensors --dtype bf16)
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/gpt_from_bf16 --set model.kind=transformer --set data.kind=tokens
    --set data.num_samples=256 --set model.d_model=32 --set model.n_layers=2 --set model.context=16 --set run.max_steps=2
    --set checkpoint.init_from=${WORK_DIR}/gpt_bf16.safetensors)
expect_in("${last_output}" "note: [0-9]+ tensor\\(s\\) of the file widened from BF16 to Float on load")
# A checkpoint of another model given as checkpoint.init_from: the model sizes that differ first, then
# each tensor on a line of its own.
run(2 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/gpt48 --set model.kind=transformer --set data.kind=tokens
    --set data.num_samples=256 --set model.d_model=48 --set model.n_layers=2 --set model.context=16 --set run.max_steps=2
    --set checkpoint.init_from=${WORK_DIR}/gpt/checkpoints)
expect_in("${last_output}" "checkpoint.init_from: '[^']*gpt/checkpoints/step_00000006.h5' holds another model than the deck's\n  model.d_model: 32 in the file, 48 in the deck\ncheckpoint '[^']*' does not match the model:\n  /model/tok.weight \\(file \\[256, 32\\] float32, expected \\[256, 48\\] float32\\)\n")

# 8. bf16 mixed precision with activation checkpointing trains and evaluates.
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/bf16 --set fsdp.mixed_precision=bf16 --set fsdp.activation_checkpointing=true)
expect_in("${last_output}" "test accuracy [0-9.]+%")

# 9. Backends and offload on a CPU machine: auto runs MPI; nccl is a clear error on every rank (no
#    GPU, CPU LibTorch); offload_params is accepted and ends with the same weights, bit for bit.
run(2 ${train2} ${DECK} --set fsdp.backend=nccl --set run.out_dir=${WORK_DIR}/nccl)
expect_in("${last_output}" "fsdp.backend = \"nccl\": no CUDA device is usable on this rank")
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/offload --set fsdp.offload_params=true --set fsdp.backend=auto)
expect_in("${last_output}" "backend mpi \\(fsdp.backend = auto\\), compute on cpu, parameter shards offloaded to host memory")
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/offload/checkpoints ${WORK_DIR}/smoke/checkpoints)
expect_in("${last_output}" "checkpoints match")

# 10. log.trace: a Chrome trace per rank with the engine's and the app's events, a memory timeline per
#     rank, and fsdp-plot draws both to PNG (when gnuplot is installed).
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/trace --set log.trace=true --set run.max_steps=8)
foreach(rank 0 1)
  file(READ ${WORK_DIR}/trace/trace_rank${rank}.json trace)
  string(JSON n LENGTH "${trace}" traceEvents)   # parses the whole file: a JSON error fails here
  if(n LESS 50)
    message(FATAL_ERROR "trace_rank${rank}.json has only ${n} events")
  endif()
  foreach(event "\"all_gather\",\"cat\":\"comm\"" "\"reduce_scatter\",\"cat\":\"comm\"" "\"forward \\(root\\)\"" "\"forward fc1\""
                "\"backward fc1\"" "\"optimizer\"" "\"checkpoint\"" "\"step 7\"" "\"resident memory\"" "\"gathered parameters\"")
    expect_in("${trace}" "${event}")
  endforeach()
  file(STRINGS ${WORK_DIR}/trace/memory_rank${rank}.csv memory LIMIT_COUNT 2)
  expect_in("${memory}" "time_s,counter,mib")
endforeach()
find_program(GNUPLOT gnuplot)
if(GNUPLOT)
  run(0 ${PLOT} ${WORK_DIR}/trace ${WORK_DIR}/smoke -o ${WORK_DIR}/plots)
  foreach(png loss memory)
    file(SIZE ${WORK_DIR}/plots/${png}.png size)
    if(size LESS 1000)
      message(FATAL_ERROR "${png}.png is ${size} bytes")
    endif()
  endforeach()
  run(2 ${PLOT} ${WORK_DIR}/nowhere)
  expect_in("${last_output}" "nowhere/metrics.csv not found")
  # A run before its first logged step: a message, and no PNG left under its name.
  file(STRINGS ${WORK_DIR}/smoke/metrics.csv header LIMIT_COUNT 1)
  file(WRITE ${WORK_DIR}/no_rows/metrics.csv "${header}\n")
  run(2 ${PLOT} ${WORK_DIR}/no_rows)
  expect_in("${last_output}" "no_rows/metrics.csv has no logged step yet")
  if(EXISTS ${WORK_DIR}/no_rows/loss.png)
    message(FATAL_ERROR "fsdp-plot left ${WORK_DIR}/no_rows/loss.png behind")
  endif()
  # gnuplot failing (a metrics.csv without the lr column): exit 1, neither the PNG nor its temporary left.
  file(WRITE ${WORK_DIR}/no_lr/metrics.csv "step,loss\n1,2.0\n2,1.5\n")
  run(1 ${PLOT} ${WORK_DIR}/no_lr)
  expect_in("${last_output}" "fsdp-plot: gnuplot could not draw [^\n]*no_lr/loss.png")
  file(GLOB left ${WORK_DIR}/no_lr/*.png ${WORK_DIR}/no_lr/.*.tmp)
  if(left)
    message(FATAL_ERROR "fsdp-plot left ${left} behind")
  endif()
else()
  message(STATUS "gnuplot not installed: fsdp-plot not tested")
endif()

# 11. Prefetching (a collective worker thread; MPI_THREAD_MULTIPLE) overlaps all-gathers and ends with the
#     same weights, bit for bit; summary.json reports what was prefetched and the exposed all-gather time.
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/prefetch --set fsdp.backward_prefetch=BACKWARD_PRE --set fsdp.forward_prefetch=true)
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/prefetch/checkpoints ${WORK_DIR}/smoke/checkpoints)
expect_in("${last_output}" "checkpoints match")
file(READ ${WORK_DIR}/prefetch/summary.json summary)
string(JSON prefetched GET "${summary}" overlap prefetched)
if(prefetched LESS 24)
  message(FATAL_ERROR "only ${prefetched} unit all-gathers were prefetched in 24 steps")
endif()
string(JSON exposed GET "${summary}" overlap exposed_all_gather_s avg)
message(STATUS "prefetched ${prefetched} unit all-gathers; exposed all-gather time ${exposed} s per rank")

# 12. Memory-bounded construction (fsdp.deferred_init): the GPT's layers are released as built and
#     initialized unit by unit inside the engine; the values do not depend on the world size, so
#     2 ranks x batch 8 == 1 rank x batch 16 (SGD, no dropout, rel <= 1e-5).
set(deferred --set fsdp.deferred_init=true --set model.kind=transformer --set data.kind=tokens --set data.num_samples=256
             --set model.d_model=32 --set model.n_layers=2 --set model.context=16 --set run.max_steps=4 --set model.dropout=0.0
             --set optim.kind=sgd --set optim.lr=0.05 --set optim.momentum=0.9 --set checkpoint.every_steps=0
             --set fsdp.auto_wrap_policy=TRANSFORMER_BASED_WRAP)
run(0 ${train2} ${DECK} ${deferred} --set data.batch_size=8 --set run.out_dir=${WORK_DIR}/deferred2)
run(0 ${train1} ${DECK} ${deferred} --set data.batch_size=16 --set run.out_dir=${WORK_DIR}/deferred1)
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/deferred2/checkpoints ${WORK_DIR}/deferred1/checkpoints --rtol 1e-5)
expect_in("${last_output}" "checkpoints match")

# 13. Overlapped gradient reductions (fsdp.overlap_grad_reduce = true: reduce-scatters and all-reduces
#     on the collective worker while backward goes on) end with the same weights, bit for bit, as
#     reductions on the computing thread, for FULL_SHARD (against the smoke run) and NO_SHARD;
#     summary.json says how many ran overlapped.
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/overlap --set fsdp.overlap_grad_reduce=true)
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/overlap/checkpoints ${WORK_DIR}/smoke/checkpoints)
expect_in("${last_output}" "checkpoints match")
file(READ ${WORK_DIR}/overlap/summary.json summary)
string(JSON overlapped GET "${summary}" overlap reductions_overlapped)
string(JSON synchronous GET "${summary}" overlap reductions_synchronous)
if(overlapped LESS 24 OR NOT synchronous EQUAL 0)
  message(FATAL_ERROR "overlap_grad_reduce=true: ${overlapped} reductions overlapped, ${synchronous} synchronous in 24 steps")
endif()
set(no_shard --set fsdp.sharding_strategy=NO_SHARD --set run.max_steps=8 --set checkpoint.every_steps=0)
run(0 ${train2} ${DECK} ${no_shard} --set run.out_dir=${WORK_DIR}/no_shard_sync --set fsdp.overlap_grad_reduce=false)
run(0 ${train2} ${DECK} ${no_shard} --set run.out_dir=${WORK_DIR}/no_shard_overlap --set fsdp.overlap_grad_reduce=true)
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/no_shard_overlap/checkpoints ${WORK_DIR}/no_shard_sync/checkpoints)
expect_in("${last_output}" "checkpoints match")
string(JSON exposed GET "${summary}" overlap exposed_reduce_s avg)
message(STATUS "overlapped ${overlapped} gradient reductions; exposed reduction time ${exposed} s per rank")

# 14. Adam's moments in bf16 (optim.state_dtype = "bf16"): the echo says so (fsdp-plan's equal
#     expectation is checked in plan_e2e, the state's bytes in test_engine); a resumed run whose saves
#     were asynchronous equals the straight one bit for bit; the checkpoint loads into fp32 moments (a
#     precision, like fsdp.mixed_precision: no refusal) and fsdp-ckpt reads it; other optimizers are
#     refused naming the key.
set(bf16_moments --set optim.state_dtype=bf16)
run(0 ${train2} ${DECK} ${bf16_moments} --set run.out_dir=${WORK_DIR}/bf16_moments)
expect_in("${last_output}" "expected [0-9.]+ MiB of params \\+ grads \\+ optimizer state \\(moments in bf16\\)")
file(READ ${WORK_DIR}/bf16_moments/summary.json summary)
expect_in("${summary}" "\"optimizer_state_dtype\": \"bf16\"")
run(0 ${train2} ${DECK} ${bf16_moments} --set run.out_dir=${WORK_DIR}/bf16_moments_resume --set run.max_steps=12 --set checkpoint.async=true)
# Step 8's save was copied beside step 9's forward and backward (checkpoint.async_copy = "background"), the
# update waiting for it: a run resumed from it ends with the straight run's weights too.
expect_in("${last_output}" "step_00000008.h5: writing in the background \\(training held [^)]*; the rest of the copy beside the next step\\)")
run(0 ${train2} ${DECK} ${bf16_moments} --set run.out_dir=${WORK_DIR}/bf16_moments_from8
    --set checkpoint.resume=${WORK_DIR}/bf16_moments_resume/checkpoints/step_00000008.h5)
expect_in("${last_output}" "resumed from [^\n]*step_00000008.h5 at step 8")
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/bf16_moments_from8/checkpoints ${WORK_DIR}/bf16_moments/checkpoints)
expect_in("${last_output}" "checkpoints match")
run(0 ${train2} ${DECK} ${bf16_moments} --set run.out_dir=${WORK_DIR}/bf16_moments_resume)
expect_in("${last_output}" "resumed from [^\n]*step_00000012.h5 at step 12")
run(0 ${CKPT_TOOL} diff ${WORK_DIR}/bf16_moments_resume/checkpoints ${WORK_DIR}/bf16_moments/checkpoints)
expect_in("${last_output}" "checkpoints match")
run(0 ${CKPT_TOOL} inspect ${WORK_DIR}/bf16_moments/checkpoints/step_00000024.h5)
expect_in("${last_output}" "bfloat16")
run(0 ${train2} ${DECK} ${bf16_moments} --set run.out_dir=${WORK_DIR}/bf16_to_fp32 --set run.max_steps=12)
run(0 ${train2} ${DECK} --set run.out_dir=${WORK_DIR}/bf16_to_fp32 --set optim.state_dtype=fp32)
expect_in("${last_output}" "resumed from [^\n]*step_00000012.h5 at step 12")
expect_not_in("${last_output}" "changed keys")
run(2 ${train2} ${DECK} ${bf16_moments} --set optim.kind=sgd --set run.out_dir=${WORK_DIR}/bf16_sgd)
expect_in("${last_output}" "optim.state_dtype[^\n]*\"bf16\" keeps adam's and adamw's moments in bf16; optim.kind is \"sgd\"")
