# End to end: the example trains under mpirun with checkpoints; fsdp-ckpt inspects, verifies,
# merges and diffs them; a run killed in the middle of a save leaves the previous checkpoint and
# `latest` valid, and resuming from it gives the same final checkpoint as an uninterrupted run.
# Variables: MPIEXEC (list), EXAMPLE, CKPT_TOOL, WORK_DIR.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

include(${CMAKE_CURRENT_LIST_DIR}/e2e_common.cmake)

set(train ${MPIEXEC} -np 2 ${EXAMPLE} --steps 6 --checkpoint-every 3)

# Uninterrupted runs, one per state dict type.
foreach(type SHARDED FULL LOCAL)
  run(TRUE ${train} --checkpoint-dir ${WORK_DIR}/${type} --state-dict-type ${type})
endforeach()

# inspect: attributes and the tensor table.
run(TRUE ${CKPT_TOOL} inspect ${WORK_DIR}/SHARDED)
expect_in("${last_output}" "state_dict_type +SHARDED_STATE_DICT")
expect_in("${last_output}" "/model/fc1.weight +\\[256, 64\\] +float32 +65536")
expect_in("${last_output}" "/optim/fc3.bias/exp_avg_sq +\\[8\\] +float32")
run(TRUE ${CKPT_TOOL} inspect ${WORK_DIR}/LOCAL/step_00000006.h5)
expect_in("${last_output}" "2 rank files")
expect_in("${last_output}" "/units/0/flat")

# verify: every checkpoint is complete and its checksums match.
foreach(path SHARDED FULL LOCAL LOCAL/step_00000003.h5)
  run(TRUE ${CKPT_TOOL} verify ${WORK_DIR}/${path})
  expect_in("${last_output}" ": OK")
endforeach()

# merge LOCAL into one file; it equals the FULL and SHARDED checkpoints of the same run.
run(TRUE ${CKPT_TOOL} merge ${WORK_DIR}/LOCAL/step_00000006.h5 ${WORK_DIR}/merged.h5)
run(TRUE ${CKPT_TOOL} verify ${WORK_DIR}/merged.h5)
run(TRUE ${CKPT_TOOL} diff ${WORK_DIR}/merged.h5 ${WORK_DIR}/FULL/step_00000006.h5)
expect_in("${last_output}" "checkpoints match")
run(TRUE ${CKPT_TOOL} diff ${WORK_DIR}/SHARDED ${WORK_DIR}/FULL)
expect_in("${last_output}" "/model/fc2.weight +ok")
# ... and differs from an older one.
run(FALSE ${CKPT_TOOL} diff ${WORK_DIR}/SHARDED/step_00000003.h5 ${WORK_DIR}/SHARDED/step_00000006.h5)
expect_in("${last_output}" "/model/fc2.weight +differs")
# ... within a tolerance that covers the difference: the verdict and every tensor's status agree.
run(TRUE ${CKPT_TOOL} diff ${WORK_DIR}/SHARDED/step_00000003.h5 ${WORK_DIR}/SHARDED/step_00000006.h5 --rtol 1e6)
expect_in("${last_output}" "/model/fc2.weight +within")
expect_in("${last_output}" "checkpoints match")
if(last_output MATCHES " differs ")
  message(FATAL_ERROR "diff within tolerance still calls a tensor 'differs':\n${last_output}")
endif()

# What is not a checkpoint is named as what it is, with a non-zero exit: a folder without one, the
# `latest` pointer, a run directory, a missing file.
file(MAKE_DIRECTORY ${WORK_DIR}/empty_folder ${WORK_DIR}/a_run/checkpoints)
file(WRITE ${WORK_DIR}/a_run/deck.toml "")
run(FALSE ${CKPT_TOOL} inspect ${WORK_DIR}/empty_folder)
expect_in("${last_output}" "empty_folder' holds no checkpoint to read")
run(FALSE ${CKPT_TOOL} verify ${WORK_DIR}/SHARDED/latest)
expect_in("${last_output}" "is the pointer file `latest`, not a checkpoint: give its folder '[^']*SHARDED' or the checkpoint it names, '[^']*step_00000006.h5'")
run(FALSE ${CKPT_TOOL} inspect ${WORK_DIR}/a_run)
expect_in("${last_output}" "a_run' is a run directory, not a checkpoint; its checkpoints are in '[^']*a_run/checkpoints'")
run(FALSE ${CKPT_TOOL} inspect ${WORK_DIR}/missing.h5)
expect_in("${last_output}" "missing.h5' does not exist")

# A truncated file fails verify with a message naming it.
execute_process(COMMAND head -c 20000 ${WORK_DIR}/SHARDED/step_00000006.h5 OUTPUT_FILE ${WORK_DIR}/truncated.h5)
run(FALSE ${CKPT_TOOL} verify ${WORK_DIR}/truncated.h5)
expect_in("${last_output}" "truncated.h5")

# A run killed in the middle of a save (files half written) and one killed after writing but before
# the commit: `latest` still names step 3, which verifies; resuming reproduces the straight run.
foreach(stage writing written)
  foreach(type SHARDED LOCAL FULL)
    set(dir ${WORK_DIR}/crash_${stage}_${type})
    run(FALSE ${train} --checkpoint-dir ${dir} --state-dict-type ${type} --crash-at ${stage}:6)
    file(READ ${dir}/latest latest)
    expect_in("${latest}" "^step_00000003.h5")
    if(EXISTS ${dir}/step_00000006.h5)
      message(FATAL_ERROR "${dir}/step_00000006.h5 exists after a crash before its commit")
    endif()
    run(TRUE ${CKPT_TOOL} verify ${dir})
    run(TRUE ${train} --checkpoint-dir ${dir} --state-dict-type ${type} --resume)
    expect_in("${last_output}" "resumed from [^\n]*step_00000003.h5 at step 3")
    if(type STREQUAL "LOCAL")
      run(TRUE ${CKPT_TOOL} merge ${dir}/step_00000006.h5 ${dir}/merged.h5)
      run(TRUE ${CKPT_TOOL} diff ${dir}/merged.h5 ${WORK_DIR}/FULL/step_00000006.h5)
    else()
      run(TRUE ${CKPT_TOOL} diff ${dir} ${WORK_DIR}/FULL)
    endif()
    expect_in("${last_output}" "checkpoints match")
  endforeach()
endforeach()
