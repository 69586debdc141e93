# Builds the engine suite with ThreadSanitizer in its own build tree and runs it under mpirun at 2 and
# 3 ranks: the collective worker (prefetched all-gathers, overlapped reductions on duplicated
# communicators), the registries autograd's threads reach, the communicators' counters. Any report in
# our code fails; Open MPI's own internals are suppressed (tests/tsan.supp: it is not instrumented).
# Variables: SOURCE_DIR, WORK_DIR, MPIEXEC (list), LAUNCHER (optional compiler launcher: ccache).
set(flags "-fsanitize=thread -fno-omit-frame-pointer")
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR} -DCMAKE_BUILD_TYPE=None
                        -DFSDP_BUILD_EXAMPLES=OFF -DFSDP_BUILD_BENCH=OFF "-DCMAKE_CXX_FLAGS=-O1 -g1 ${flags}" "-DCMAKE_EXE_LINKER_FLAGS=${flags}"
                        "-DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER}"
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(rc)
  message(FATAL_ERROR "configure of the ThreadSanitizer build failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR} --target test_engine -j 2 RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc)
  message(FATAL_ERROR "ThreadSanitizer build failed: ${rc}\n${out}\n${err}")
endif()
set(ENV{TSAN_OPTIONS} "halt_on_error=0 report_signal_unsafe=0 suppressions=${SOURCE_DIR}/tests/tsan.supp")
foreach(np 2 3)
  execute_process(COMMAND ${MPIEXEC} -np ${np} -x TSAN_OPTIONS ${WORK_DIR}/bin/test_engine --report_level=short --color_output=false
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc OR "${out}${err}" MATCHES "ThreadSanitizer")
    message(FATAL_ERROR "under ThreadSanitizer: test_engine at ${np} ranks (${rc})\n${out}\n${err}")
  endif()
  message(STATUS "clean under ThreadSanitizer: test_engine at ${np} ranks")
endforeach()
message(STATUS "thread sanitizer tests passed")
