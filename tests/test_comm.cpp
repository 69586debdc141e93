// MpiComm collectives against values computed locally; run at np = 1, 2, 3, 4.
#define BOOST_TEST_MODULE fsdp_comm
#include <boost/test/unit_test.hpp>

#include <cmath>
#include <cstring>
#include <vector>

#include "common.hpp"
#include "fsdp/comm/agree.hpp"
#include "fsdp/comm/mpi_comm.hpp"

using fsdp::DType;
using fsdp::MpiComm;
using fsdp::ReduceOp;

using CommFixture = MpiFixture<>;
BOOST_TEST_GLOBAL_FIXTURE(CommFixture);

static float value(int rank, std::int64_t i) { return static_cast<float>(rank * 1000 + i) * 0.5f; }

BOOST_AUTO_TEST_CASE(all_gather_concatenates) {
  auto w = MpiComm::world();
  for (std::int64_t n : {0, 1, 5, 1000}) {
    std::vector<float> send(static_cast<std::size_t>(n)), recv(static_cast<std::size_t>(n * w.size()), -1);
    for (std::int64_t i = 0; i < n; ++i) send[static_cast<std::size_t>(i)] = value(w.rank(), i);
    w.all_gather(send.data(), recv.data(), n, DType::kFloat32);
    for (int r = 0; r < w.size(); ++r)
      for (std::int64_t i = 0; i < n; ++i) BOOST_TEST(recv[static_cast<std::size_t>(r * n + i)] == value(r, i));
  }
}

BOOST_AUTO_TEST_CASE(reduce_scatter_sum_and_avg) {
  auto w = MpiComm::world();
  for (std::int64_t n : {1, 3, 777}) {
    std::vector<double> send(static_cast<std::size_t>(n * w.size())), sum(static_cast<std::size_t>(n)), avg(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < send.size(); ++i) send[i] = value(w.rank(), static_cast<std::int64_t>(i));
    w.reduce_scatter(send.data(), sum.data(), n, DType::kFloat64, ReduceOp::kSum);
    w.reduce_scatter(send.data(), avg.data(), n, DType::kFloat64, ReduceOp::kAvg);
    for (std::int64_t i = 0; i < n; ++i) {
      double expect = 0;
      for (int r = 0; r < w.size(); ++r) expect += value(r, w.rank() * n + i);
      BOOST_TEST(sum[static_cast<std::size_t>(i)] == expect, boost::test_tools::tolerance(1e-12));
      BOOST_TEST(avg[static_cast<std::size_t>(i)] == expect / w.size(), boost::test_tools::tolerance(1e-12));
    }
  }
}

BOOST_AUTO_TEST_CASE(reduce_scatter_bfloat16_uses_ring_add) {
  auto w = MpiComm::world();
  const std::int64_t n = 4;
  std::vector<std::uint16_t> send(static_cast<std::size_t>(n * w.size())), recv(static_cast<std::size_t>(n));
  for (auto& v : send) v = fsdp::detail::float_to_bf16(1.5f);
  w.reduce_scatter(send.data(), recv.data(), n, DType::kBFloat16, ReduceOp::kSum);
  for (auto v : recv) BOOST_TEST(fsdp::detail::bf16_to_float(v) == 1.5f * w.size());
  for (auto& v : send) v = fsdp::detail::float_to_f16(0.25f);
  w.reduce_scatter(send.data(), recv.data(), n, DType::kFloat16, ReduceOp::kAvg);
  for (auto v : recv) BOOST_TEST(fsdp::detail::f16_to_float(v) == 0.25f);
}

// A chunk longer than a ring segment goes round in segments: every element is still added in the
// ring's order (rank k+1's value first, rank k's last for chunk k), bit for bit, across the seams.
BOOST_AUTO_TEST_CASE(a_chunk_longer_than_a_ring_segment_keeps_the_ring_order) {
  auto w = MpiComm::world();
  const int world = w.size();
  const std::int64_t segment = fsdp::detail::kRingSegmentBytes / 4;
  auto x = [](int rank, std::int64_t i) { return std::sin(static_cast<float>(i % 9973) * 0.37f + static_cast<float>(rank)) * 1e3f; };
  for (std::int64_t n : {segment - 1, segment + 3, 2 * segment + 1}) {
    BOOST_TEST_CONTEXT("n=" << n) {
      std::vector<float> send(static_cast<std::size_t>(n * world)), recv(static_cast<std::size_t>(n), -1.0f);
      for (std::size_t i = 0; i < send.size(); ++i) send[i] = x(w.rank(), static_cast<std::int64_t>(i));
      w.reduce_scatter(send.data(), recv.data(), n, DType::kFloat32, ReduceOp::kSum);
      std::int64_t mismatches = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t at = w.rank() * n + i;
        float expect = x((w.rank() + 1) % world, at);
        for (int k = 2; k <= world; ++k) expect += x((w.rank() + k) % world, at);
        if (std::memcmp(&expect, &recv[static_cast<std::size_t>(i)], 4) != 0) ++mismatches;
      }
      BOOST_TEST(mismatches == 0);
    }
  }
  // bf16: segments of twice the elements, each add rounded to bf16 in the same order.
  using fsdp::detail::bf16_to_float;
  using fsdp::detail::float_to_bf16;
  const std::int64_t n = 2 * (fsdp::detail::kRingSegmentBytes / 2) + 1;
  std::vector<std::uint16_t> send(static_cast<std::size_t>(n * world)), recv(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < send.size(); ++i) send[i] = float_to_bf16(x(w.rank(), static_cast<std::int64_t>(i)));
  w.reduce_scatter(send.data(), recv.data(), n, DType::kBFloat16, ReduceOp::kSum);
  std::int64_t mismatches = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t at = w.rank() * n + i;
    std::uint16_t expect = float_to_bf16(x((w.rank() + 1) % world, at));
    for (int k = 2; k <= world; ++k) expect = float_to_bf16(bf16_to_float(float_to_bf16(x((w.rank() + k) % world, at))) + bf16_to_float(expect));
    if (expect != recv[static_cast<std::size_t>(i)]) ++mismatches;
  }
  BOOST_TEST(mismatches == 0);
  std::vector<float> none;
  BOOST_CHECK_THROW(w.reduce_scatter(none.data(), none.data(), -1, DType::kFloat32, ReduceOp::kSum), fsdp::CommError);
}

BOOST_AUTO_TEST_CASE(all_reduce_of_16_bit_floats) {
  auto w = MpiComm::world();
  // 1, 5, 7: the gather-and-add path for small buffers; 5003 (prime: padded for every world size > 1):
  // the ring. Values stay small integers, exact in bf16 and fp16.
  for (std::int64_t n : {1, 5, 7, 5003}) {
    std::vector<std::uint16_t> b(static_cast<std::size_t>(n)), h(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
      b[static_cast<std::size_t>(i)] = fsdp::detail::float_to_bf16(static_cast<float>(w.rank() + i % 8));
      h[static_cast<std::size_t>(i)] = fsdp::detail::float_to_f16(static_cast<float>(2 * (i % 8)));
    }
    w.all_reduce(b.data(), b.data(), n, DType::kBFloat16, ReduceOp::kSum);
    w.all_reduce(h.data(), h.data(), n, DType::kFloat16, ReduceOp::kAvg);
    const float rank_sum = static_cast<float>(w.size() * (w.size() - 1) / 2);
    for (std::int64_t i = 0; i < n; ++i) {
      BOOST_TEST(fsdp::detail::bf16_to_float(b[static_cast<std::size_t>(i)]) == rank_sum + static_cast<float>(i % 8 * w.size()));
      BOOST_TEST(fsdp::detail::f16_to_float(h[static_cast<std::size_t>(i)]) == static_cast<float>(2 * (i % 8)));
    }
  }
  std::uint16_t one = fsdp::detail::float_to_bf16(1.0f);
  BOOST_CHECK_THROW(w.all_reduce(&one, &one, 1, DType::kBFloat16, ReduceOp::kMax), fsdp::CommError);
}

BOOST_AUTO_TEST_CASE(all_reduce_broadcast_barrier) {
  auto w = MpiComm::world();
  std::vector<std::int64_t> x(3, w.rank() + 1);
  w.all_reduce(x.data(), x.data(), 3, DType::kInt64, ReduceOp::kSum);
  for (auto v : x) BOOST_TEST(v == w.size() * (w.size() + 1) / 2);
  std::vector<float> y(2, static_cast<float>(w.rank()));
  w.all_reduce(y.data(), y.data(), 2, DType::kFloat32, ReduceOp::kAvg);
  for (auto v : y) BOOST_TEST(v == (w.size() - 1) / 2.0f);
  std::vector<double> m(2, static_cast<double>(w.rank()) - 0.5);
  w.all_reduce(m.data(), m.data(), 2, DType::kFloat64, ReduceOp::kMax);
  for (auto v : m) BOOST_TEST(v == w.size() - 1.5);
  std::vector<float> b(5, static_cast<float>(w.rank() + 10));
  w.broadcast(b.data(), 5, DType::kFloat32, w.size() - 1);
  for (auto v : b) BOOST_TEST(v == static_cast<float>(w.size() - 1 + 10));
  w.barrier();
}

BOOST_AUTO_TEST_CASE(non_blocking_variants_match_blocking) {
  auto w = MpiComm::world();
  const std::int64_t n = 33;
  std::vector<float> send(static_cast<std::size_t>(n * w.size())), rs(static_cast<std::size_t>(n)), rs_ref(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < send.size(); ++i) send[i] = value(w.rank(), static_cast<std::int64_t>(i));
  auto req = w.ireduce_scatter(send.data(), rs.data(), n, DType::kFloat32, ReduceOp::kAvg);
  req.wait();
  w.reduce_scatter(send.data(), rs_ref.data(), n, DType::kFloat32, ReduceOp::kAvg);
  for (std::int64_t i = 0; i < n; ++i)
    BOOST_TEST(rs[static_cast<std::size_t>(i)] == rs_ref[static_cast<std::size_t>(i)], boost::test_tools::tolerance(1e-5f));
  std::vector<float> ag(static_cast<std::size_t>(n * w.size()));
  auto g = w.iall_gather(send.data(), ag.data(), n, DType::kFloat32);
  while (!g.test()) {}
  for (int r = 0; r < w.size(); ++r) BOOST_TEST(ag[static_cast<std::size_t>(r * n)] == value(r, 0));
  std::vector<double> ar(4, 1.0);
  auto a = w.iall_reduce(ar.data(), ar.data(), 4, DType::kFloat64, ReduceOp::kSum);
  a.wait();
  BOOST_TEST(ar[0] == static_cast<double>(w.size()));
  std::vector<std::int32_t> bc(2, w.rank());
  auto b = w.ibroadcast(bc.data(), 2, DType::kInt32, 0);
  b.wait();
  BOOST_TEST(bc[1] == 0);
}

BOOST_AUTO_TEST_CASE(split_into_groups) {
  auto w = MpiComm::world();
  const int group = w.size() % 2 == 0 ? 2 : 1;
  auto shard = w.split(w.rank() / group, w.rank());
  auto replica = w.split(w.rank() % group, w.rank());
  BOOST_TEST(shard.size() == group);
  BOOST_TEST(replica.size() == w.size() / group);
  BOOST_TEST(shard.rank() == w.rank() % group);
  std::int64_t x = w.rank();
  shard.all_reduce(&x, &x, 1, DType::kInt64, ReduceOp::kSum);
  const int base = (w.rank() / group) * group;
  BOOST_TEST(x == (group == 2 ? base + base + 1 : base));
  auto node = w.split_node();
  BOOST_TEST(node.size() >= 1);
}

BOOST_AUTO_TEST_CASE(counters_count_bytes) {
  auto w = MpiComm::world().split(0, MpiComm::world().rank());
  std::vector<float> send(8), recv(static_cast<std::size_t>(8 * w.size()));
  w.all_gather(send.data(), recv.data(), 8, DType::kFloat32);
  BOOST_TEST(w.counters().all_gather_bytes == 32u);
  BOOST_TEST(w.counters().calls == 1u);
  w.reset_counters();
  BOOST_TEST(w.counters().total_bytes() == 0u);
}

BOOST_AUTO_TEST_CASE(half_conversions_round_trip) {
  for (float f : {0.0f, 1.0f, -2.5f, 65504.0f, 6.1035156e-05f, 2.98023224e-07f}) {
    BOOST_TEST(fsdp::detail::f16_to_float(fsdp::detail::float_to_f16(f)) == f, boost::test_tools::tolerance(1e-3f));
  }
  for (float f : {0.0f, 1.0f, -2.5f, 1.0e30f})
    BOOST_TEST(fsdp::detail::bf16_to_float(fsdp::detail::float_to_bf16(f)) == f, boost::test_tools::tolerance(1e-2f));
}

BOOST_AUTO_TEST_CASE(placement_on_one_machine) {
  auto w = MpiComm::world();
  const auto p = w.placement();
  BOOST_TEST(p.rank == w.rank());
  BOOST_TEST(p.size == w.size());
  BOOST_TEST(p.nodes == 1);  // every rank of a test run shares this machine
  BOOST_TEST(p.local_size == w.size());
  BOOST_TEST(p.local_rank == w.rank());
}

// The collective worker's communicators wait by polling and sleeping (set_waiting_yields_cpu): every
// collective must give the same bits as the blocking form, floating-point all-reduce included (both
// run the same algorithm with a fixed order of additions: the gather-and-add for buffers of at most
// 8 KiB gathered, the ring above; both sides of the cut-off are tested), in place and not, for sizes
// that are and are not multiples of the ranks; and every rank must hold the same bits.
BOOST_AUTO_TEST_CASE(yielding_waits_give_the_same_bits_as_blocking) {
  auto blocking = MpiComm::world();
  auto yielding = blocking.split(0, blocking.rank());
  yielding.set_waiting_yields_cpu(true);
  BOOST_TEST(yielding.waiting_yields_cpu());
  BOOST_TEST(!blocking.waiting_yields_cpu());
  const int world = blocking.size();
  std::vector<float> nothing;  // n = 0: every rank returns at once, and the ranks stay in step
  blocking.all_reduce(nothing.data(), nothing.data(), 0, DType::kFloat32, ReduceOp::kSum);
  yielding.all_reduce(nothing.data(), nothing.data(), 0, DType::kFloat32, ReduceOp::kAvg);
  // The cut-off between the two paths: 8 KiB gathered is the last size that gathers and adds.
  const std::int64_t last_gathered = 8 * 1024 / (4 * world);
  for (std::int64_t n : {std::int64_t{1}, std::int64_t{7}, std::int64_t{64}, last_gathered, last_gathered + 1, std::int64_t{10001}}) {
    BOOST_TEST_CONTEXT("n=" << n) {
      std::vector<float> x(static_cast<std::size_t>(n * world));
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(static_cast<float>(i) * 0.37f + static_cast<float>(blocking.rank())) * 1e3f;
      for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        std::vector<float> a(x), b(x), c(x.size()), d(x.size());
        blocking.all_reduce(a.data(), a.data(), n, DType::kFloat32, op);  // in place
        yielding.all_reduce(b.data(), b.data(), n, DType::kFloat32, op);
        blocking.all_reduce(x.data(), c.data(), n * world, DType::kFloat32, op);  // out of place, another size
        yielding.all_reduce(x.data(), d.data(), n * world, DType::kFloat32, op);
        BOOST_TEST(std::memcmp(a.data(), b.data(), static_cast<std::size_t>(n) * 4) == 0);
        BOOST_TEST(std::memcmp(c.data(), d.data(), c.size() * 4) == 0);
        std::vector<float> everyones(static_cast<std::size_t>(n * world));
        blocking.all_gather(a.data(), everyones.data(), n, DType::kFloat32);
        for (int r = 1; r < world; ++r) BOOST_TEST(std::memcmp(everyones.data(), everyones.data() + r * n, static_cast<std::size_t>(n) * 4) == 0);
        for (std::int64_t i = 0; i < n; ++i) {  // and the value: the sum over ranks
          double expect = 0;
          for (int r = 0; r < world; ++r) expect += std::sin(static_cast<float>(i) * 0.37f + static_cast<float>(r)) * 1e3f;
          if (op == ReduceOp::kAvg) expect /= world;
          BOOST_TEST(a[static_cast<std::size_t>(i)] == expect, boost::test_tools::tolerance(1e-4));
        }
        std::vector<float> rs1(static_cast<std::size_t>(n)), rs2(static_cast<std::size_t>(n));
        blocking.reduce_scatter(x.data(), rs1.data(), n, DType::kFloat32, op);
        yielding.reduce_scatter(x.data(), rs2.data(), n, DType::kFloat32, op);
        BOOST_TEST(std::memcmp(rs1.data(), rs2.data(), rs1.size() * 4) == 0);
      }
      std::vector<float> g1(x.size()), g2(x.size());
      blocking.all_gather(x.data(), g1.data(), n, DType::kFloat32);
      yielding.all_gather(x.data(), g2.data(), n, DType::kFloat32);
      BOOST_TEST(std::memcmp(g1.data(), g2.data(), g1.size() * 4) == 0);
      std::vector<std::uint16_t> h1(static_cast<std::size_t>(n)), h2(static_cast<std::size_t>(n));
      for (std::int64_t i = 0; i < n; ++i)
        h1[static_cast<std::size_t>(i)] = h2[static_cast<std::size_t>(i)] = fsdp::detail::float_to_bf16(x[static_cast<std::size_t>(i)]);
      blocking.all_reduce(h1.data(), h1.data(), n, DType::kBFloat16, ReduceOp::kAvg);
      yielding.all_reduce(h2.data(), h2.data(), n, DType::kBFloat16, ReduceOp::kAvg);
      BOOST_TEST(h1 == h2);
      std::vector<std::int64_t> i1(3, blocking.rank() + 1), i2(i1);
      blocking.all_reduce(i1.data(), i1.data(), 3, DType::kInt64, ReduceOp::kSum);
      yielding.all_reduce(i2.data(), i2.data(), 3, DType::kInt64, ReduceOp::kSum);
      BOOST_TEST(i1 == i2);
      std::vector<float> bc(static_cast<std::size_t>(n), static_cast<float>(blocking.rank()));
      yielding.broadcast(bc.data(), n, DType::kFloat32, world - 1);
      BOOST_TEST(bc.front() == static_cast<float>(world - 1));
      BOOST_TEST(bc.back() == static_cast<float>(world - 1));
    }
  }
}

BOOST_AUTO_TEST_CASE(agree_on_failure_names_the_lowest_failing_rank) {
  auto w = MpiComm::world();
  BOOST_TEST(!fsdp::agree_on_failure(w, std::nullopt).has_value());
  // The odd ranks fail (rank 1 is the lowest); rank 3 also sets the flag.
  std::optional<std::string> error;
  if (w.rank() % 2 == 1) error = "rank " + std::to_string(w.rank()) + " failed";
  const auto odd = fsdp::agree_on_failure(w, error, w.rank() == 3);
  if (w.size() == 1) {
    BOOST_TEST(!odd.has_value());
  } else {
    BOOST_REQUIRE(odd.has_value());
    BOOST_TEST(odd->rank == 1);
    BOOST_TEST(odd->message == "rank 1 failed");
    BOOST_TEST(odd->failed_ranks == w.size() / 2);
    BOOST_TEST(odd->flagged == (w.size() > 3));
  }
  const auto all = fsdp::agree_on_failure(w, "failed on " + std::to_string(w.rank()));
  BOOST_REQUIRE(all.has_value());
  BOOST_TEST(all->rank == 0);
  BOOST_TEST(all->message == "failed on 0");
  BOOST_TEST(all->failed_ranks == w.size());
  BOOST_TEST(!all->flagged);
}
