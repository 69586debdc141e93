# The tokenizer (app/text): hand-checked ids and errors; no MPI, no LibTorch.
if(TARGET fsdp_text)
  add_executable(test_tokenizer ${CMAKE_CURRENT_LIST_DIR}/test_tokenizer.cpp)
  target_link_libraries(test_tokenizer PRIVATE fsdp_text fsdp_data)
  fsdp_boost_test(test_tokenizer)
  add_test(NAME test_tokenizer COMMAND test_tokenizer --color_output=false --report_level=short)
  set_tests_properties(test_tokenizer PROPERTIES TIMEOUT 300 LABELS "data")
endif()
