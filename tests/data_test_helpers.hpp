// Shared by the data layer's suites (test_data, test_token_files): a temporary folder, raw files and
// the check that a DataError names what it must.
#pragma once

#include <boost/test/unit_test.hpp>
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data.hpp"
#include "fsdp/file_tree.hpp"

namespace fsdp::test {

using Bytes = std::vector<std::uint8_t>;

// A fresh directory per test case, removed afterwards.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "fsdp_test_data_XXXXXX").string();
    BOOST_TEST_REQUIRE(mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fsdp::remove_tree(path, ec);
  }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

inline void write_raw(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  BOOST_TEST_REQUIRE(out.good());
}

// Runs `f`, which must throw DataError whose message contains every one of `parts`.
template <class F>
void expect_data_error(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    BOOST_ERROR("no DataError thrown; expected one containing '" << parts.front() << "'");
  } catch (const fsdp::app::DataError& e) {
    const std::string what = e.what();
    BOOST_TEST(e.id() == "fsdp.data");
    BOOST_TEST(what.rfind("[fsdp.data] ", 0) == 0u, what);
    for (const auto& p : parts) BOOST_TEST(what.find(p) != std::string::npos, "'" << p << "' not in: " << what);
  }
}

}  // namespace fsdp::test
