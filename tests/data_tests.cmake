# The data layer of fsdp-train (app/data.hpp): no MPI, no LibTorch, runs in about a second
# (plus reading Fashion-MNIST when /usr/share/datasets/fashion-mnist is installed).
find_package(ZLIB REQUIRED)  # imported targets are per directory; the test writes .gz files itself
add_executable(test_data ${CMAKE_CURRENT_LIST_DIR}/test_data.cpp)
target_link_libraries(test_data PRIVATE fsdp_data ZLIB::ZLIB)
fsdp_boost_test(test_data)
add_test(NAME test_data COMMAND test_data --color_output=false --report_level=short)
set_tests_properties(test_data PROPERTIES TIMEOUT 300 LABELS "data")
# Token files (llm.c, nanoGPT, Megatron indexed datasets): the same library, its own suite.
add_executable(test_token_files ${CMAKE_CURRENT_LIST_DIR}/test_token_files.cpp)
target_link_libraries(test_token_files PRIVATE fsdp_data)
fsdp_boost_test(test_token_files)
add_test(NAME test_token_files COMMAND test_token_files --color_output=false --report_level=short)
set_tests_properties(test_token_files PROPERTIES TIMEOUT 300 LABELS "data")
# Weighted mixtures (app/mixture.hpp, data.sources): the blend, the sources' epochs, world sizes, resumes.
add_executable(test_mixture ${CMAKE_CURRENT_LIST_DIR}/test_mixture.cpp)
target_link_libraries(test_mixture PRIVATE fsdp_data)
fsdp_boost_test(test_mixture)
add_test(NAME test_mixture COMMAND test_mixture --color_output=false --report_level=short)
set_tests_properties(test_mixture PROPERTIES TIMEOUT 300 LABELS "data")
