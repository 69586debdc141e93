// Library version (kept in step with project(VERSION) in CMakeLists.txt).
#pragma once

namespace fsdp {
inline constexpr const char* kVersion = "0.1.0";
}  // namespace fsdp
