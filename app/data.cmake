# fsdp_data: the data layer of fsdp-train (IDX/MNIST, DistributedSampler, token data and files, Prefetcher).
# Plain C++20 + zlib, no LibTorch and no MPI, so it compiles in seconds and its tests need no mpirun.
find_package(ZLIB REQUIRED)
find_package(Threads REQUIRED)
add_library(fsdp_data STATIC ${CMAKE_CURRENT_LIST_DIR}/data.cpp ${CMAKE_CURRENT_LIST_DIR}/token_stream.cpp ${CMAKE_CURRENT_LIST_DIR}/mixture.cpp)
target_include_directories(fsdp_data PUBLIC ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/app)
target_compile_features(fsdp_data PUBLIC cxx_std_20)
# Threads is PUBLIC: the Prefetcher template in data.hpp starts std::threads in the user's code.
target_link_libraries(fsdp_data PUBLIC ZLIB::ZLIB Threads::Threads)
