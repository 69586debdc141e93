# Builds suites with a sanitizer in their own build tree and runs them; any report fails.
#   KIND=address: AddressSanitizer + UndefinedBehaviorSanitizer over the unit and multi-rank tests (core
#     math, MPI communicator, decks, data readers, the sharding engine, checkpoints), the communicator
#     and engine suites under mpirun at 2 and 3 ranks, the checkpoint suite at 2 (at 3 ranks on 2 cores
#     it took 174 s against 23 s, the ranks giving up the cores in turn; the plain build runs it at 1-4).
#     Leak reports are off: Open MPI keeps allocations until exit.
#   KIND=thread: ThreadSanitizer over the core suite (the periodic thread and the watcher pattern of the
#     NCCL lane) and the engine suite at 2 ranks (the collective worker, the registries autograd's
#     threads reach, the communicators' counters: the threads of one rank, which 3 ranks run the same
#     way, in 63 s against 30); Open MPI's own internals are suppressed (tests/tsan.supp: it is not
#     instrumented).
# Variables: KIND, SOURCE_DIR, WORK_DIR, MPIEXEC (list), LAUNCHER (optional compiler launcher: ccache).
if(KIND STREQUAL "address")
  set(flags "-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined")
  set(optimize "-O0")
  set(name "ASan+UBSan")
  set(targets test_core test_comm test_deck test_data test_engine test_checkpoint)
  set(options_var ASAN_OPTIONS)
  set(ENV{ASAN_OPTIONS} "detect_leaks=0")
  set(ENV{UBSAN_OPTIONS} "print_stacktrace=1")
  set(report "runtime error|AddressSanitizer")
  set(commands "${WORK_DIR}/bin/test_core" "${WORK_DIR}/bin/test_deck" "${WORK_DIR}/bin/test_data")
  set(ranked test_comm:2 test_comm:3 test_engine:2 test_engine:3 test_checkpoint:2)  # suite:ranks
  set(done "sanitizer tests passed")
elseif(KIND STREQUAL "thread")
  set(flags "-fsanitize=thread -fno-omit-frame-pointer")
  set(optimize "-O1")
  set(name "ThreadSanitizer")
  set(targets test_core test_engine)
  set(options_var TSAN_OPTIONS)
  set(ENV{TSAN_OPTIONS} "halt_on_error=0 report_signal_unsafe=0 suppressions=${SOURCE_DIR}/tests/tsan.supp")
  set(report "ThreadSanitizer")
  set(commands "${WORK_DIR}/bin/test_core")
  set(ranked test_engine:2)
  set(done "thread sanitizer tests passed")
else()
  message(FATAL_ERROR "sanitize.cmake: KIND must be address or thread, got '${KIND}'")
endif()
# One command per list element, its words joined by '|' (a CMake list cannot hold lists).
string(REPLACE ";" "|" mpiexec "${MPIEXEC}")
foreach(run ${ranked})
  string(REPLACE ":" ";" run "${run}")
  list(GET run 0 suite)
  list(GET run 1 np)
  list(APPEND commands "${mpiexec}|-np|${np}|-x|${options_var}|${WORK_DIR}/bin/${suite}")
endforeach()
# -g1: line tables, enough for the reports' stack traces. The tensor math is LibTorch's (not
# instrumented), so the optimization level decides the compile time more than the run time: ASan at -O0
# builds its LibTorch suites in two thirds of -O1's time (test_engine 200 s against 303, test_checkpoint
# 145 against 232, from a cold cache) and runs them 10-15% slower in all; TSan stays at -O1, where -O0 would save
# 100 s of build and cost 23 s of run (docs/reliability.md). RelWithDebInfo's -O2 -g took twice -O1's.
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR} -DCMAKE_BUILD_TYPE=None
                        -DFSDP_BUILD_EXAMPLES=OFF -DFSDP_BUILD_BENCH=OFF "-DCMAKE_CXX_FLAGS=${optimize} -g1 ${flags}" "-DCMAKE_EXE_LINKER_FLAGS=${flags}"
                        "-DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER}" "-DFSDP_BUILD_GROUP=${targets}"
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(rc)
  message(FATAL_ERROR "configure of the ${name} build failed: ${rc}")
endif()
# One target that depends on the suites (FSDP_BUILD_GROUP), so that make compiles them side by side:
# `--target A B` builds A, then B, each alone (the ASan build took 325 s that way, 180 s with build_group).
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR} --target build_group -j 2 RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc)
  message(FATAL_ERROR "${name} build failed: ${rc}\n${out}\n${err}")
endif()
foreach(joined IN LISTS commands)
  string(REPLACE "|" ";" cmd "${joined}")
  execute_process(COMMAND ${cmd} --report_level=short --color_output=false RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc OR "${out}${err}" MATCHES "${report}")
    message(FATAL_ERROR "under ${name}: ${cmd} (${rc})\n${out}\n${err}")
  endif()
  message(STATUS "clean under ${name}: ${cmd}")
endforeach()
message(STATUS "${done}")
