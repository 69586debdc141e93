# Input decks (app layer, included from app/CMakeLists.txt): the fsdp_deck library and fsdp-sweep.
# No LibTorch and no MPI: both build in seconds.

# toml++: Debian's libtomlplusplus-dev ships a compiled library and a CMake package; without the
# package, the header alone works in header-only mode.
find_package(tomlplusplus CONFIG QUIET)
if(TARGET tomlplusplus::tomlplusplus)
  # The imported target must be visible from tests/ too, where fsdp_deck's link interface names it.
  get_target_property(_fsdp_toml_imported tomlplusplus::tomlplusplus IMPORTED)
  get_target_property(_fsdp_toml_global tomlplusplus::tomlplusplus IMPORTED_GLOBAL)
  if(_fsdp_toml_imported AND NOT _fsdp_toml_global)
    set_target_properties(tomlplusplus::tomlplusplus PROPERTIES IMPORTED_GLOBAL TRUE)
  endif()
  set(FSDP_TOML_TARGET tomlplusplus::tomlplusplus)
else()
  find_path(FSDP_TOMLPP_INCLUDE_DIR toml++/toml.h REQUIRED)
  add_library(fsdp_tomlplusplus INTERFACE)
  target_include_directories(fsdp_tomlplusplus SYSTEM INTERFACE ${FSDP_TOMLPP_INCLUDE_DIR})
  target_compile_definitions(fsdp_tomlplusplus INTERFACE TOML_HEADER_ONLY=1)
  set(FSDP_TOML_TARGET fsdp_tomlplusplus)
endif()

add_library(fsdp_deck STATIC ${CMAKE_CURRENT_LIST_DIR}/deck.cpp ${CMAKE_CURRENT_LIST_DIR}/deck_changes.cpp ${CMAKE_CURRENT_LIST_DIR}/deck_tables.cpp ${CMAKE_CURRENT_LIST_DIR}/deck_schema.cpp ${CMAKE_CURRENT_LIST_DIR}/deck_schema_outputs.cpp ${CMAKE_CURRENT_LIST_DIR}/deck_schema_model.cpp ${CMAKE_CURRENT_LIST_DIR}/hf_config.cpp ${CMAKE_CURRENT_LIST_DIR}/deck_reference.cpp ${CMAKE_CURRENT_LIST_DIR}/run_config.cpp)
target_include_directories(fsdp_deck PUBLIC ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/app ${PROJECT_BINARY_DIR}/generated)
target_compile_features(fsdp_deck PUBLIC cxx_std_20)
target_link_libraries(fsdp_deck PRIVATE ${FSDP_TOML_TARGET})

# fsdp-sweep DECK --grid key=v1,v2 ... --out DIR: one deck per grid point and a manifest for a Slurm job array.
add_executable(fsdp-sweep ${CMAKE_CURRENT_LIST_DIR}/fsdp_sweep.cpp)
target_link_libraries(fsdp-sweep PRIVATE fsdp_deck)
install(TARGETS fsdp-sweep RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
