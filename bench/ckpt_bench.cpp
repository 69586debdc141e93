// Checkpoint throughput benchmark (bench): times save_checkpoint / load_checkpoint for SHARDED, FULL
// and LOCAL state dicts, save_safetensors / load_safetensors of the weights (against a load in which
// rank 0 reads the whole file and broadcasts each tensor, with each rank's peak memory growth) of a stack of Linear layers (FULL_SHARD, one unit per Linear, Adam with state
// after one step, so a checkpoint is parameters + exp_avg + exp_avg_sq), against raw POSIX
// write()+fsync / read() of the same number of bytes, and serial HDF5 writes of the same tensors
// with and without the Fletcher32 filter, and through fsdp::h5::write_flat_range as FULL writes them
// (where the time of a FULL save goes, minus the gather).
//
//   mpirun --oversubscribe --allow-run-as-root -np 2 build/bin/fsdp_ckpt_bench [--width 2048] [--layers 16]
//          [--reps 3] [--dir DIR] [--types SHARDED,FULL,LOCAL] [--no-drop-caches] [--no-h5-breakdown]
//
// Every timed operation is bracketed by barriers and timed on rank 0, so a time is the wall time of
// the whole collective operation. Before each timed operation rank 0 runs sync() and, unless
// --no-drop-caches, writes 3 to /proc/sys/vm/drop_caches so that loads read from the disk (the
// report says whether that worked). Rank 0 prints markdown tables.
#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <malloc.h>
#include <fsdp/fsdp.hpp>
#include <fsdp/io/safetensors.hpp>
#include <mpi.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <thread>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>
#include "fsdp/file_tree.hpp"

namespace {

// `layers` x Linear(width, width) with ReLU, and an output scale of `width` elements that stays in the
// root unit (so the root unit has parameters of its own, as in most real models).
struct StackImpl : torch::nn::Module {
  StackImpl(std::int64_t width, int layers) {
    for (int i = 0; i < layers; ++i) fc.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(width, width)));
    scale = register_parameter("scale", torch::ones({width}));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& layer : fc) x = torch::relu(fsdp::forward(layer, x));
    return x * scale;
  }
  std::vector<torch::nn::Linear> fc;
  torch::Tensor scale;
};

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Samples {
  std::vector<double> s;
  double best() const { return s.empty() ? 0 : *std::min_element(s.begin(), s.end()); }
  double median() const {
    if (s.empty()) return 0;
    auto v = s;
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  }
};

struct Row {
  std::string method, writers;
  std::int64_t bytes = 0;
  Samples save, load;
};

/// sync() and, if asked, drop the page cache. Rank 0 only (one kernel per machine). True if dropped.
bool flush_caches(bool drop) {
  ::sync();
  if (!drop) return false;
  std::ofstream f("/proc/sys/vm/drop_caches");
  if (!f) return false;
  f << "3\n";
  f.flush();
  return static_cast<bool>(f);
}

void check_posix(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what + ": " + std::strerror(errno));
}

void write_file(const std::string& path, const char* data, std::int64_t bytes) {
  const int fd = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY, 0644);
  check_posix(fd >= 0, "open " + path);
  constexpr std::int64_t kBlock = 16 << 20;
  for (std::int64_t off = 0; off < bytes;) {
    const auto n = ::write(fd, data + off, static_cast<std::size_t>(std::min(kBlock, bytes - off)));
    check_posix(n > 0, "write " + path);
    off += n;
  }
  check_posix(::fsync(fd) == 0, "fsync " + path);
  check_posix(::close(fd) == 0, "close " + path);
}

void read_file(const std::string& path, char* data, std::int64_t bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  check_posix(fd >= 0, "open " + path);
  constexpr std::int64_t kBlock = 16 << 20;
  for (std::int64_t off = 0; off < bytes;) {
    const auto n = ::read(fd, data + off, static_cast<std::size_t>(std::min(kBlock, bytes - off)));
    check_posix(n > 0, "read " + path);
    off += n;
  }
  check_posix(::close(fd) == 0, "close " + path);
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

void print_table(const std::vector<Row>& rows) {
  std::printf("| method | writers | bytes | save best s | save median s | save GB/s | load best s | load median s | load GB/s |\n");
  std::printf("|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const auto& r : rows) {
    const double gb = r.bytes / 1e9;
    auto t = [](const Samples& s) { return s.s.empty() ? std::string("-") : fmt("%.3f", s.best()); };
    auto m = [](const Samples& s) { return s.s.empty() ? std::string("-") : fmt("%.3f", s.median()); };
    auto bw = [&](const Samples& s) { return s.s.empty() ? std::string("-") : fmt("%.2f", gb / s.best()); };
    std::printf("| %s | %s | %.1f MB | %s | %s | %s | %s | %s | %s |\n", r.method.c_str(), r.writers.c_str(), r.bytes / 1e6, t(r.save).c_str(),
                m(r.save).c_str(), bw(r.save).c_str(), t(r.load).c_str(), m(r.load).c_str(), bw(r.load).c_str());
  }
}

// ---- peak memory of a load ---------------------------------------------------------------------

/// A field of /proc/self/status in KiB (VmRSS, VmHWM).
std::int64_t status_kib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  return -1;
}

/// This process's peak RSS while `f` runs, sampled every millisecond from /proc/self/statm (the
/// kernel's own high-water mark cannot be reset everywhere), in KiB.
template <class F>
std::int64_t peak_rss_kib_during(F&& f) {
  std::atomic<bool> done{false};
  std::atomic<std::int64_t> peak{0};
  const std::int64_t page_kib = ::sysconf(_SC_PAGESIZE) / 1024;
  auto sample = [&] {
    std::ifstream in("/proc/self/statm");
    std::int64_t size = 0, resident = 0;
    in >> size >> resident;
    peak = std::max<std::int64_t>(peak.load(), resident * page_kib);
  };
  std::thread sampler([&] {
    while (!done) {
      sample();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  try {
    f();
  } catch (...) {
    done = true;
    sampler.join();
    throw;
  }
  sample();
  done = true;
  sampler.join();
  return peak;
}

/// The load Accelerate's cpu_ram_efficient_loading and FSDP's sync_module_states amount to: rank 0
/// reads the whole file into memory, then broadcasts each tensor; every rank keeps its own slices.
template <class Engine>
void load_on_rank0_and_broadcast(Engine& engine, const std::string& path) {
  auto& world = engine.comm();
  const auto header = fsdp::safetensors::read_header(path);
  std::vector<char> file;
  if (world.rank() == 0) {
    file.resize(static_cast<std::size_t>(header.data_start + header.data_bytes));
    read_file(path, file.data(), static_cast<std::int64_t>(file.size()));
  }
  torch::NoGradGuard no_grad;
  for (const auto& u : engine.sharded_units()) {
    if (u.empty()) continue;
    auto shard = u.shard.detach();
    for (std::size_t i = 0; i < u.param_names.size(); ++i) {
      const auto* e = header.find(u.param_names[i]);
      if (!e) throw std::runtime_error("no tensor " + u.param_names[i] + " in " + path);
      auto full = torch::empty({(e->end - e->begin) / 4}, torch::kFloat);
      if (world.rank() == 0) std::memcpy(full.data_ptr(), file.data() + header.data_start + e->begin, static_cast<std::size_t>(e->end - e->begin));
      world.broadcast(full.data_ptr(), full.numel(), fsdp::DType::kFloat32, 0);
      for (const auto& slice : u.layout.slices(u.shard_rank))
        if (slice.param_index == static_cast<std::int64_t>(i))
          shard.narrow(0, slice.shard_offset, slice.numel).copy_(full.narrow(0, slice.param_offset, slice.numel));
    }
  }
}

const std::map<std::string, std::string> kLoadMethods = {{"ranges", "fsdp safetensors, weights only (each rank its byte ranges)"},
                                                         {"rank0", "safetensors weights, rank 0 reads the file and broadcasts (Accelerate's way)"}};

template <class Engine>
void load_weights(const std::string& how, Engine& engine, const std::string& path) {
  if (how == "ranges")
    fsdp::load_safetensors(engine, path, {.buffers = false});
  else
    load_on_rank0_and_broadcast(engine, path);
}

// ---- serial HDF5 breakdown: the tensors a FULL save writes, from rank 0 alone ---------------------

enum class H5Layout { kContiguous, kChunked, kChunkedFletcher32, kLibraryFlatRange };

const char* layout_name(H5Layout l) {
  switch (l) {
    case H5Layout::kContiguous: return "HDF5 serial, contiguous, no filter";
    case H5Layout::kChunked: return "HDF5 serial, 1 MiB chunks, no filter";
    case H5Layout::kChunkedFletcher32: return "HDF5 serial, 1 MiB chunks + Fletcher32 (FULL's layout)";
    case H5Layout::kLibraryFlatRange: return "HDF5 serial, FULL's layout, through fsdp::h5::write_flat_range / read_flat_range";
  }
  return "?";
}

void h5_write(const std::string& path, const std::vector<torch::Tensor>& tensors, H5Layout layout) {
  namespace h5 = fsdp::h5;
  h5::silence_errors();
  h5::Id fapl = h5::file_access();
  h5::Id file(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl), "H5Fcreate " + path);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (layout == H5Layout::kLibraryFlatRange) {  // what FULL does per tensor: 1-D memory space, box selection in the file
      const std::string name = "/t" + std::to_string(i);
      h5::Id ds = h5::create_dataset(file, name, h5::ElementType::kFloat32, t.sizes().vec());
      h5::write_flat_range(ds, t.sizes().vec(), 0, t.numel(), h5::ElementType::kFloat32, t.data_ptr(), H5P_DEFAULT, name);
      continue;
    }
    std::vector<hsize_t> dims(t.sizes().begin(), t.sizes().end());
    h5::Id space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), "H5Screate_simple");
    h5::Id dcpl(H5Pcreate(H5P_DATASET_CREATE), "H5Pcreate");
    if (layout != H5Layout::kContiguous) {
      const auto chunk = h5::chunk_shape(dims, 4);
      h5::check(H5Pset_chunk(dcpl, static_cast<int>(chunk.size()), chunk.data()), "H5Pset_chunk");
      if (layout == H5Layout::kChunkedFletcher32) h5::check(H5Pset_fletcher32(dcpl), "H5Pset_fletcher32");
    }
    h5::check(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER), "H5Pset_fill_time");
    const std::string name = "/t" + std::to_string(i);
    h5::Id ds(H5Dcreate2(file, name.c_str(), H5T_IEEE_F32LE, space, H5P_DEFAULT, dcpl, H5P_DEFAULT), "H5Dcreate2");
    h5::check(H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, t.data_ptr()), "H5Dwrite");
  }
  file.close("H5Fclose");
  fsdp::ckpt::fsync_path(path);
}

void h5_read(const std::string& path, std::vector<torch::Tensor>& tensors, bool flat_range) {
  namespace h5 = fsdp::h5;
  h5::Id fapl = h5::file_access();
  h5::Id file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl), "H5Fopen " + path);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const std::string name = "/t" + std::to_string(i);
    h5::Id ds(H5Dopen2(file, name.c_str(), H5P_DEFAULT), "H5Dopen2");
    if (flat_range) {
      h5::read_flat_range(ds, tensors[i].sizes().vec(), 0, tensors[i].numel(), h5::ElementType::kFloat32, tensors[i].data_ptr(), name);
      continue;
    }
    h5::check(H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, tensors[i].data_ptr()), "H5Dread");
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t width = 2048;
  int layers = 16, reps = 3;
  std::string dir;
  bool no_drop = false, no_h5 = false, with_safetensors = true;
  std::string types_text = "SHARDED,FULL,LOCAL";
  CLI::App cli{"fsdp checkpoint throughput benchmark", "fsdp_ckpt_bench"};
  cli.add_option("--width", width, "features of each Linear(width, width)")->check(CLI::PositiveNumber);
  cli.add_option("--layers", layers, "number of Linear layers")->check(CLI::PositiveNumber);
  cli.add_option("--reps", reps, "repetitions of each timed operation")->check(CLI::PositiveNumber);
  cli.add_option("--dir", dir, "folder for the checkpoints (default: a new folder under /tmp, removed at the end)");
  cli.add_option("--types", types_text, "state dict types to time, comma separated");
  cli.add_flag("--no-drop-caches", no_drop, "do not drop the page cache before each timed operation");
  cli.add_flag("--no-h5-breakdown", no_h5, "skip the serial HDF5 rows");
  cli.add_flag("!--no-safetensors", with_safetensors, "skip the safetensors rows");
  std::string rss_probe;
  cli.add_option("--rss-probe", rss_probe,
                 "only load the weights once this way (ranges: each rank its byte ranges; rank0: rank 0 reads all and broadcasts) and print "
                 "each rank's peak RSS growth as a table row")
      ->check(CLI::IsMember({"ranges", "rank0"}));
  CLI11_PARSE(cli, argc, argv);
  try {
    fsdp::MpiEnvironment env(&argc, &argv);
    auto world = fsdp::MpiComm::world();
    const int rank = world.rank(), np = world.size();
    torch::set_num_threads(1);
    torch::manual_seed(0);

    // The folder: rank 0 makes it and tells the others.
    bool made_dir = false;
    if (rank == 0) {
      if (dir.empty()) {
        char tmpl[] = "/tmp/fsdp_ckpt_bench.XXXXXX";
        if (!::mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
        dir = tmpl;
        made_dir = true;
      } else {
        made_dir = !std::filesystem::exists(dir);
        std::filesystem::create_directories(dir);
      }
    }
    dir = fsdp::broadcast_string(world, dir);

    auto net = std::make_shared<StackImpl>(width, layers);
    fsdp::FsdpOptions options;
    options.sharding_strategy = fsdp::ShardingStrategy::FULL_SHARD;
    options.auto_wrap_policy = fsdp::AutoWrapPolicy::module_types({"Linear"});
    auto model = fsdp::make_fsdp(net, world, options);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-4));
    {  // one step so that exp_avg and exp_avg_sq exist
      auto x = torch::randn({8, width});
      opt.zero_grad();
      model->forward(x).pow(2).mean().backward();
      opt.step();
    }
    const std::int64_t numel = static_cast<std::int64_t>(layers) * (width * width + width) + width;
    const std::int64_t payload = 3 * 4 * numel;  // parameters + exp_avg + exp_avg_sq, fp32

    // References for checking every load.
    std::vector<torch::Tensor> ref_params, ref_sq;
    for (const auto& p : model->parameters()) {
      ref_params.push_back(p.detach().clone());
      const auto& st = static_cast<const torch::optim::AdamParamState&>(*opt.state().at(fsdp::optimizer_state_key(p)));
      ref_sq.push_back(st.exp_avg_sq().clone());
    }
    auto scramble = [&] {
      torch::NoGradGuard g;
      for (auto& p : model->parameters()) p.detach().zero_();
      for (auto& [k, st] : opt.state()) static_cast<torch::optim::AdamParamState&>(*st).exp_avg_sq().zero_();
    };
    auto verify = [&](const std::string& what) {
      const auto params = model->parameters();
      std::int64_t bad = 0;
      for (std::size_t i = 0; i < params.size(); ++i) {
        const auto& st = static_cast<const torch::optim::AdamParamState&>(*opt.state().at(fsdp::optimizer_state_key(params[i])));
        if (!torch::equal(params[i].detach(), ref_params[i]) || !torch::equal(st.exp_avg_sq(), ref_sq[i])) ++bad;
      }
      world.all_reduce(&bad, &bad, 1, fsdp::DType::kInt64, fsdp::ReduceOp::kSum);
      if (bad) throw std::runtime_error(what + ": loaded state differs from the saved state in " + std::to_string(bad) + " tensors");
    };

    bool dropped = false;
    auto prepare = [&] {  // outside the timed region
      std::int64_t ok = 0;
      if (rank == 0) ok = flush_caches(!no_drop) ? 1 : 0;
      world.broadcast(&ok, 1, fsdp::DType::kInt64, 0);
      dropped = ok != 0;
      world.barrier();
    };
    auto timed = [&](auto&& f) {
      prepare();
      const auto t0 = Clock::now();
      f();
      world.barrier();
      return seconds_since(t0);
    };
    auto remove_on_rank0 = [&](const std::filesystem::path& p) {
      if (rank == 0) fsdp::remove_tree(p);
      world.barrier();
    };

    if (rank == 0) {
      std::printf(
          "# fsdp_ckpt_bench: %d ranks, %d Linear(%lld, %lld) layers + a scale = %lld parameters (%.1f MB fp32), FULL_SHARD, one unit per Linear, "
          "Adam\n",
          np, layers, static_cast<long long>(width), static_cast<long long>(width), static_cast<long long>(numel), 4.0 * numel / 1e6);
      std::printf("# payload (parameters + exp_avg + exp_avg_sq): %lld bytes = %.1f MB; reps %d; dir %s; torch threads %d\n",
                  static_cast<long long>(payload), payload / 1e6, reps, dir.c_str(), torch::get_num_threads());
      std::fflush(stdout);
    }

    auto verify_weights = [&](const std::string& how) {
      std::int64_t bad = 0;
      const auto params = model->parameters();
      for (std::size_t i = 0; i < params.size(); ++i) bad += torch::equal(params[i].detach(), ref_params[i]) ? 0 : 1;
      world.all_reduce(&bad, &bad, 1, fsdp::DType::kInt64, fsdp::ReduceOp::kSum);
      if (bad) throw std::runtime_error("safetensors load (" + how + "): " + std::to_string(bad) + " tensors differ from the saved ones");
    };
    if (!rss_probe.empty()) {
      // One load in a fresh process: the peak RSS growth it causes on each rank. Large blocks are
      // mapped and unmapped (not kept in the heap), so that RSS follows the bytes live.
      mallopt(M_MMAP_THRESHOLD, 1 << 20);
      const auto st_path = (std::filesystem::path(dir) / "probe.safetensors").string();
      fsdp::save_safetensors(*model, st_path, {.buffers = false});
      scramble();
      malloc_trim(0);
      world.barrier();
      const double before = static_cast<double>(status_kib("VmRSS"));
      const double peak = static_cast<double>(peak_rss_kib_during([&] { load_weights(rss_probe, *model, st_path); }));
      verify_weights(rss_probe);
      double growth = (peak - before) / 1024.0;
      std::vector<double> all(static_cast<std::size_t>(np));
      world.all_gather(&growth, all.data(), 1, fsdp::DType::kFloat64);
      remove_on_rank0(st_path);
      if (rank == 0) {
        double others = 0;
        for (std::size_t i = 1; i < all.size(); ++i) others = std::max(others, all[i]);
        std::printf("| %s | %d | %.1f | %.1f | %s |\n", kLoadMethods.at(rss_probe).c_str(), np, 4.0 * numel / 1048576.0, all[0],
                    np > 1 ? fmt("%.1f", others).c_str() : "-");
        if (made_dir) fsdp::remove_tree(dir);
      }
      world.barrier();
      return 0;
    }

    std::vector<Row> rows;
    std::map<std::string, std::vector<std::array<double, 3>>> stages;  // type -> per rep: writing, written, committed
    const std::string types_list = types_text + ",";
    for (std::size_t pos = 0; pos < types_list.size();) {
      const auto comma = types_list.find(',', pos);
      const std::string name = types_list.substr(pos, comma - pos);
      pos = comma + 1;
      if (name.empty()) continue;
      fsdp::CheckpointOptions co;
      co.state_dict_type =
          fsdp::parse_state_dict_type(name.find('_') == std::string::npos ? name + "_STATE_DICT" : name);  // SHARDED or SHARDED_STATE_DICT ...
      Clock::time_point t_start;
      std::array<double, 3> st{};
      co.on_stage = [&](const std::string& s, std::int64_t) {
        const double t = seconds_since(t_start);
        if (s == "writing")
          st[0] = t;
        else if (s == "written")
          st[1] = t;
        else if (s == "committed")
          st[2] = t;
      };
      Row row;
      row.method = std::string("fsdp ") + fsdp::to_string(co.state_dict_type);
      row.writers = co.state_dict_type == fsdp::StateDictType::FULL_STATE_DICT ? "rank 0" : "all " + std::to_string(np);
      const auto ckdir = std::filesystem::path(dir) / ("ckpt_" + name);
      for (int r = 0; r < reps; ++r) {
        remove_on_rank0(ckdir);
        fsdp::SaveResult saved;
        row.save.s.push_back(timed([&] {
          t_start = Clock::now();
          saved = fsdp::save_checkpoint(*model, &opt, ckdir.string(), {.step = 1}, co);
        }));
        stages[row.method].push_back(st);
        row.bytes = saved.bytes;
        scramble();
        row.load.s.push_back(timed([&] { fsdp::load_checkpoint(*model, &opt, saved.path, nullptr, co); }));
        verify(row.method);
      }
      remove_on_rank0(ckdir);
      rows.push_back(row);
      if (rank == 0) {
        std::printf("# %s done: save best %.3f s, load best %.3f s, %lld bytes\n", row.method.c_str(), row.save.best(), row.load.best(),
                    static_cast<long long>(row.bytes));
        std::fflush(stdout);
      }
    }

    // ---- safetensors: the weights, every rank its own byte ranges, against rank 0 reading all --------
    if (with_safetensors) {
      const auto st_path = (std::filesystem::path(dir) / "model.safetensors").string();
      Row mine{kLoadMethods.at("ranges"), "all " + std::to_string(np), 0, {}, {}};
      Row rank0{kLoadMethods.at("rank0"), "rank 0", 0, {}, {}};
      for (int r = 0; r < reps; ++r) {
        remove_on_rank0(st_path);
        fsdp::SafetensorsSaveResult saved;
        mine.save.s.push_back(timed([&] { saved = fsdp::save_safetensors(*model, st_path, {.buffers = false}); }));
        mine.bytes = rank0.bytes = saved.bytes;
        scramble();
        mine.load.s.push_back(timed([&] { load_weights("ranges", *model, st_path); }));
        verify_weights("ranges");
        scramble();
        rank0.load.s.push_back(timed([&] { load_weights("rank0", *model, st_path); }));
        verify_weights("rank0");
      }
      remove_on_rank0(st_path);
      rows.push_back(mine);
      rows.push_back(rank0);
    }

    // ---- raw POSIX baselines --------------------------------------------------------------------
    const auto raw_dir = std::filesystem::path(dir) / "raw";
    if (rank == 0) std::filesystem::create_directories(raw_dir);
    world.barrier();
    {
      const std::int64_t share = (payload + np - 1) / np;
      std::vector<char> buf(static_cast<std::size_t>(share));
      for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<char>((i * 2654435761u + rank) >> 13);
      const std::string path = (raw_dir / ("rank_" + std::to_string(rank) + ".bin")).string();
      Row row{"raw write()+fsync / read(), one file per rank", "all " + std::to_string(np), share * np, {}, {}};
      for (int r = 0; r < reps; ++r) {
        std::filesystem::remove(path);
        world.barrier();
        row.save.s.push_back(timed([&] { write_file(path, buf.data(), share); }));
        row.load.s.push_back(timed([&] { read_file(path, buf.data(), share); }));
      }
      std::filesystem::remove(path);
      rows.push_back(row);
    }
    {
      std::vector<char> buf(rank == 0 ? static_cast<std::size_t>(payload) : 0);
      for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<char>((i * 2654435761u) >> 13);
      const std::string path = (raw_dir / "all.bin").string();
      Row row{"raw write()+fsync / read(), rank 0 alone, one file", "rank 0", payload, {}, {}};
      for (int r = 0; r < reps; ++r) {
        remove_on_rank0(path);
        row.save.s.push_back(timed([&] {
          if (rank == 0) write_file(path, buf.data(), payload);
        }));
        row.load.s.push_back(timed([&] {
          if (rank == 0) read_file(path, buf.data(), payload);
        }));
      }
      remove_on_rank0(path);
      rows.push_back(row);
    }

    // ---- serial HDF5 from rank 0: FULL's tensors without the gather -----------------------------
    if (!no_h5) {
      std::vector<torch::Tensor> tensors;
      if (rank == 0) {
        auto gen = at::detail::createCPUGenerator(1);
        for (int copy = 0; copy < 3; ++copy)
          for (int l = 0; l < layers; ++l) {
            tensors.push_back(torch::randn({width, width}, gen));
            tensors.push_back(torch::randn({width}, gen));
          }
        for (int copy = 0; copy < 3; ++copy) tensors.push_back(torch::randn({width}, gen));
      }
      for (auto layout : {H5Layout::kContiguous, H5Layout::kChunked, H5Layout::kChunkedFletcher32, H5Layout::kLibraryFlatRange}) {
        const std::string path = (raw_dir / "h5.h5").string();
        Row row{layout_name(layout), "rank 0", 0, {}, {}};
        for (int r = 0; r < reps; ++r) {
          remove_on_rank0(path);
          row.save.s.push_back(timed([&] {
            if (rank == 0) h5_write(path, tensors, layout);
          }));
          row.load.s.push_back(timed([&] {
            if (rank == 0) h5_read(path, tensors, layout == H5Layout::kLibraryFlatRange);
          }));
        }
        if (rank == 0) row.bytes = static_cast<std::int64_t>(std::filesystem::file_size(path));
        world.broadcast(&row.bytes, 1, fsdp::DType::kInt64, 0);
        remove_on_rank0(path);
        rows.push_back(row);
      }
    }
    remove_on_rank0(raw_dir);

    if (rank == 0) {
      std::printf("\npage cache before each timed operation: %s\n\n", no_drop ? "not dropped (--no-drop-caches); sync() only"
                                                                      : dropped
                                                                          ? "dropped (sync; echo 3 > /proc/sys/vm/drop_caches)"
                                                                          : "could NOT be dropped (sync() only): loads may read from the page cache");
      print_table(rows);
      std::printf("\nsave phases on rank 0, median over reps, seconds from the start of save_checkpoint:\n\n");
      std::printf("| method | parameters written (\"writing\") | files closed (\"written\") | committed (fsync + rename + latest) |\n");
      std::printf("|---|---:|---:|---:|\n");
      for (const auto& [method, v] : stages) {
        Samples a, b, c;
        for (const auto& s : v) {
          a.s.push_back(s[0]);
          b.s.push_back(s[1]);
          c.s.push_back(s[2]);
        }
        std::printf("| %s | %.3f | %.3f | %.3f |\n", method.c_str(), a.median(), b.median(), c.median());
      }
      std::fflush(stdout);
      if (made_dir) fsdp::remove_tree(dir);
    }
    world.barrier();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp_ckpt_bench: %s\n", e.what());
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
}
