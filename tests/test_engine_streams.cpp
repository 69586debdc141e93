// The engine's GPU overlap path, run on CPU (part of test_engine, np 1-4): with a communicator whose
// collectives progress on their own (NCCL's stream), prefetches and gradient reductions are
// non-blocking collectives issued from the computing thread and ordered at their use, with no worker
// thread, and the host never waits for the stream; and the bridge that orders NCCL's stream against
// LibTorch's current CUDA stream.
#include <boost/test/unit_test.hpp>

#include "engine_harness.hpp"
#include "fsdp/torch/current_stream_order.hpp"
#include "issuing_comm.hpp"  // runs the GPU path's logic (issue, keep buffers alive, order at the end of backward) here

BOOST_AUTO_TEST_CASE(overlap_without_a_worker_as_on_gpus_trains_like_one_process) {
  const int n = MpiComm::world().size();
  const Setup setup{.clip = 0.5, .accum = 2};
  const auto reference = train_reference(ModelKind::kMlp, OptimKind::kAdam, n, setup);
  auto cases = strategies_and_groups(n);
  for (const auto& [strategy, group] : cases) {
    for (const bool world_optimizer : {false, true}) {
      if (world_optimizer && (strategy != ShardingStrategy::HYBRID_SHARD || group == n)) continue;
      BOOST_TEST_CONTEXT(to_string(strategy) << " group " << group << (world_optimizer ? " optimizer over the world" : "")) {
        FsdpOptions options;
        options.sharding_strategy = strategy;
        options.shard_group_size = group;
        if (world_optimizer) options.optimizer_sharding = fsdp::OptimizerSharding::WORLD;
        options.auto_wrap_policy = AutoWrapPolicy::module_types({"Linear", "Scale", "TiedOut"});
        options.overlap_grad_reduce = true;
        options.backward_prefetch = fsdp::BackwardPrefetch::BACKWARD_PRE;
        auto net = std::static_pointer_cast<MlpImpl>(make_model(ModelKind::kMlp));
        IssuingComm::host_waits = 0;
        const auto trained = train_fsdp_typed(ModelKind::kMlp, OptimKind::kAdam, options, net, setup, IssuingComm(MpiComm::world()));
        BOOST_TEST(IssuingComm::host_waits == 0);   // stream-ordered to the end: the host waits only where it reads
        compare(trained.params, reference.params);  // the whole model: see compare()
        for (std::size_t i = 0; i < trained.norms.size(); ++i) BOOST_TEST(trained.norms[i] == reference.norms[i], boost::test_tools::tolerance(1e-5));
        if (n > 1) {  // a world of one reduces nothing
          BOOST_TEST(trained.overlap.reductions_overlapped > 0);
          BOOST_TEST(trained.overlap.reductions_synchronous == 0);
        }
        // Backward prefetches what forward freed: FULL_SHARD, and hybrid over groups of 2 or more.
        const bool regathers = n > 1 && (strategy == ShardingStrategy::FULL_SHARD || (strategy == ShardingStrategy::HYBRID_SHARD && group > 1));
        BOOST_TEST((trained.overlap.prefetched > 0) == regathers);
      }
    }
  }
}

// The bridge that orders NCCL's stream against LibTorch's current CUDA stream, run here against a
// recording CUDA guard (a GPU build registers CUDA's own, whose record takes the given event and whose
// block makes the stream wait for it): it records the communicator's own event handle on, and makes
// wait, the stream current at the moment of the call.
BOOST_AUTO_TEST_CASE(collectives_are_ordered_against_the_stream_current_when_they_are_issued) {
  struct RecordingCudaGuard final : c10::impl::DeviceGuardImplInterface {
    c10::DeviceType type() const override { return c10::DeviceType::CUDA; }
    c10::Device exchangeDevice(c10::Device d) const override { return d; }
    c10::Device getDevice() const override { return c10::Device(c10::kCUDA, 0); }
    void setDevice(c10::Device) const override {}
    void uncheckedSetDevice(c10::Device) const noexcept override {}
    c10::Stream getStream(c10::Device d) const noexcept override { return c10::Stream(c10::Stream::UNSAFE, d, current); }
    c10::Stream exchangeStream(c10::Stream s) const noexcept override {
      const auto old = getStream(s.device());
      current = s.id();
      return old;
    }
    c10::DeviceIndex deviceCount() const noexcept override { return 2; }
    mutable c10::StreamId current = 0;
    struct Call {
      std::string what;
      c10::StreamId stream;
      c10::DeviceIndex device;
      void* event;
    };
    mutable std::vector<Call> calls;
    void record(void** event, const c10::Stream& stream, const c10::DeviceIndex index, const c10::EventFlag) const override {
      calls.push_back({"record", stream.id(), index, *event});
    }
    void block(void* event, const c10::Stream& stream) const override { calls.push_back({"block", stream.id(), stream.device_index(), event}); }
  };
  static RecordingCudaGuard fake;  // the registry does not own it
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<std::size_t>(c10::DeviceType::CUDA)];
  struct Registered {  // for this test only, also when a check throws
    std::atomic<const c10::impl::DeviceGuardImplInterface*>& slot;
    const c10::impl::DeviceGuardImplInterface* before;
    ~Registered() { slot.store(before); }
  } registered{slot, slot.load()};
  slot.store(&fake);
  const c10::Device gpu(c10::kCUDA, 1);
  int ready = 0, done = 0;  // stand-ins for the communicator's cudaEvent_t handles
  const auto order = fsdp::detail::current_stream_order(gpu);
  fake.exchangeStream(c10::Stream(c10::Stream::UNSAFE, gpu, 7));
  order.record(&ready);
  order.wait(&done);
  fake.exchangeStream(c10::Stream(c10::Stream::UNSAFE, gpu, 9));  // the caller switched streams
  order.record(&ready);
  BOOST_TEST_REQUIRE(fake.calls.size() == 3u);
  BOOST_TEST(fake.calls[0].what == "record");
  BOOST_TEST(fake.calls[0].stream == 7);
  BOOST_TEST(fake.calls[0].device == 1);
  BOOST_TEST(fake.calls[0].event == static_cast<void*>(&ready));  // the given handle, not a new event
  BOOST_TEST(fake.calls[1].what == "block");
  BOOST_TEST(fake.calls[1].stream == 7);
  BOOST_TEST(fake.calls[1].event == static_cast<void*>(&done));
  BOOST_TEST(fake.calls[2].stream == 9);
}
