# fsdp_text: Hugging Face byte-level BPE tokenizers (app/text/tokenizer.hpp). Plain C++20 with ICU
# (Unicode regular expressions, NFC) and nlohmann-json: no LibTorch, no MPI. Without ICU there is no
# tokenizer and no fsdp-tokenize (scripts/deps.sh installs libicu-dev).
find_package(ICU COMPONENTS uc i18n)
if(ICU_FOUND)
  add_library(fsdp_text STATIC ${CMAKE_CURRENT_LIST_DIR}/text/tokenizer.cpp)
  target_include_directories(fsdp_text PUBLIC ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/app)
  target_compile_features(fsdp_text PUBLIC cxx_std_20)
  target_link_libraries(fsdp_text PUBLIC ICU::uc ICU::i18n nlohmann_json::nlohmann_json)
else()
  message(STATUS "ICU not found: no tokenizer and no fsdp-tokenize (install libicu-dev)")
endif()
