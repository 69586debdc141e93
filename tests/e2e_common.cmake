# Helpers shared by the end-to-end CMake scripts (included with include()).

# run(EXPECTED_RC COMMAND...): runs COMMAND, keeps its output in `last_output`, fails unless the exit
# code is EXPECTED_RC (TRUE: 0, FALSE: anything but 0, or a number).
function(run expect_rc)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(last_output "${out}${err}" PARENT_SCOPE)
  string(JOIN " " cmd ${ARGN})
  if(expect_rc STREQUAL "TRUE")
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "failed (${rc}): ${cmd}\n${out}\n${err}")
    endif()
  elseif(expect_rc STREQUAL "FALSE")
    if(rc EQUAL 0)
      message(FATAL_ERROR "should have failed: ${cmd}\n${out}\n${err}")
    endif()
  elseif(NOT rc STREQUAL "${expect_rc}")
    message(FATAL_ERROR "exit code ${rc}, expected ${expect_rc}: ${cmd}\n${out}\n${err}")
  endif()
  message(STATUS "ok (${rc}): ${cmd}")
endfunction()

# expect_in(TEXT REGEX): fails unless TEXT matches REGEX.
function(expect_in text pattern)
  if(NOT text MATCHES "${pattern}")
    message(FATAL_ERROR "expected '${pattern}' in:\n${text}")
  endif()
endfunction()

# expect_not_in(TEXT REGEX): fails if TEXT matches REGEX.
function(expect_not_in text pattern)
  if(text MATCHES "${pattern}")
    message(FATAL_ERROR "did not expect '${pattern}' in:\n${text}")
  endif()
endfunction()
