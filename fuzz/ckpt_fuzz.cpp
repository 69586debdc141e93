// libFuzzer target: the checkpoint reader (fsdp-ckpt inspect and verify). Any file must be read or
// refused with a CheckpointError; never a crash.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "fsdp/io/checkpoint_tools.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string path = "/tmp/fsdp_ckpt_fuzz_" + std::to_string(::getpid()) + ".h5";
  if (FILE* f = std::fopen(path.c_str(), "wb")) {
    std::fwrite(data, 1, size, f);
    std::fclose(f);
  }
  try {
    (void)fsdp::ckpt::inspect_file(path);
  } catch (const fsdp::CheckpointError&) {}
  (void)fsdp::ckpt::verify(path);  // reports problems, never throws
  return 0;
}
