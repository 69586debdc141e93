# Builds the unit and multi-rank tests (core math, MPI communicator, decks, data readers, the
# sharding engine, checkpoints) with AddressSanitizer + UndefinedBehaviorSanitizer in their own
# build tree and runs them, the multi-rank suites under mpirun at 2 and 3 ranks. Any memory error
# or undefined behaviour fails.
# Variables: SOURCE_DIR, WORK_DIR, MPIEXEC (list), LAUNCHER (optional compiler launcher: ccache).
set(flags "-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined")
# -O1 -g1 (line tables: enough for the reports' stack traces), not RelWithDebInfo's -O2 -g: the LibTorch
# suites then compile in half the time, and run as fast (the tensor math is in LibTorch, not instrumented).
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR} -DCMAKE_BUILD_TYPE=None
                        -DFSDP_BUILD_EXAMPLES=OFF -DFSDP_BUILD_BENCH=OFF "-DCMAKE_CXX_FLAGS=-O1 -g1 ${flags}" "-DCMAKE_EXE_LINKER_FLAGS=${flags}"
                        "-DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER}"
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(rc)
  message(FATAL_ERROR "configure of the sanitizer build failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR} --target test_core test_comm test_deck test_data test_engine test_checkpoint -j 2 RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc)
  message(FATAL_ERROR "sanitizer build failed: ${rc}\n${out}\n${err}")
endif()
# Leak reports are off: Open MPI keeps allocations until exit by design.
set(ENV{ASAN_OPTIONS} "detect_leaks=0")
set(ENV{UBSAN_OPTIONS} "print_stacktrace=1")
foreach(cmd "${WORK_DIR}/bin/test_core" "${WORK_DIR}/bin/test_deck" "${WORK_DIR}/bin/test_data"
        "${MPIEXEC};-np;2;-x;ASAN_OPTIONS;${WORK_DIR}/bin/test_comm" "${MPIEXEC};-np;3;-x;ASAN_OPTIONS;${WORK_DIR}/bin/test_comm"
        "${MPIEXEC};-np;2;-x;ASAN_OPTIONS;${WORK_DIR}/bin/test_engine" "${MPIEXEC};-np;3;-x;ASAN_OPTIONS;${WORK_DIR}/bin/test_engine"
        "${MPIEXEC};-np;2;-x;ASAN_OPTIONS;${WORK_DIR}/bin/test_checkpoint" "${MPIEXEC};-np;3;-x;ASAN_OPTIONS;${WORK_DIR}/bin/test_checkpoint")
  execute_process(COMMAND ${cmd} --report_level=short --color_output=false RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc OR "${out}${err}" MATCHES "runtime error|AddressSanitizer")
    message(FATAL_ERROR "under sanitizers: ${cmd} (${rc})\n${out}\n${err}")
  endif()
  message(STATUS "clean under ASan+UBSan: ${cmd}")
endforeach()
message(STATUS "sanitizer tests passed")
