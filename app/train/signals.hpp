// fsdp-train (app layer): the process's signals. SIGTERM, SIGUSR1, SIGINT and SIGHUP ask for a
// graceful stop; SIGTERM also dumps the flight recorder (a peer died, or the job ends); fatal signals
// dump it and die.
#pragma once

#include <fsdp/fsdp.hpp>
#include <semaphore.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "choices.hpp"
#include "mapped_files.hpp"
#include "train/ranks.hpp"

namespace fsdp::app {

/// The signal that asked for a graceful stop (SIGTERM, SIGUSR1, SIGINT, SIGHUP), 0 if none.
inline volatile std::sig_atomic_t g_stop_signal = 0;
/// Posted by the SIGTERM handler (sem_post is async-signal-safe) for TerminateDumper's thread.
inline sem_t g_terminate_posted;
inline volatile std::sig_atomic_t g_terminate_pending = 0;
extern "C" inline void request_stop(int signo) {
  // A second Ctrl-C while the first one's stop is pending (a long evaluation, a save, a wait) ends the
  // process at once, as Ctrl-C does elsewhere; the last committed checkpoint is the one to resume from.
  if (signo == SIGINT && g_stop_signal == SIGINT) {
    std::signal(SIGINT, SIG_DFL);
    std::raise(SIGINT);
    return;
  }
  g_stop_signal = signo;
  if (signo == SIGTERM) {
    g_terminate_pending = 1;
    sem_post(&g_terminate_posted);
  }
}

/// A stop signal's name, as the messages say it.
inline std::string stop_signal_name(std::int64_t signo) {
  switch (signo) {
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    case SIGINT: return "SIGINT";
    case SIGHUP: return "SIGHUP";
    default: return "signal " + std::to_string(signo);
  }
}

/// Whoever started the process made it ignore `signo` (nohup for SIGHUP, a non-interactive shell's `&`
/// for SIGINT): that choice stands.
inline bool ignored_by_the_launcher(int signo) {
  struct sigaction current {};
  return ::sigaction(signo, nullptr, &current) == 0 && current.sa_handler == SIG_IGN;
}

/// SIGUSR1 asks for a checkpoint and a requeue (sbatch --signal): its default action kills, so a
/// request during a long start (a big model loading) would end the job unrequeued. Handled from the
/// start of a training run; the first step acts on it.
inline void stop_after_the_first_step_on_usr1() { std::signal(SIGUSR1, request_stop); }

/// SIGTERM (Slurm's time limit, scancel), SIGUSR1 (sbatch --signal), SIGINT (Ctrl-C) and SIGHUP (the
/// terminal or ssh session gone) finish the step, save and exit 3. Before training starts SIGTERM,
/// SIGINT and SIGHUP keep their default action: nothing is lost yet, and stopping at once is what they
/// ask for. Past a file size limit (ulimit -f) a write fails with EFBIG and the save reports it,
/// instead of SIGXFSZ killing the rank in the middle of a checkpoint.
inline void stop_after_the_step_on_signals() {
  std::signal(SIGTERM, request_stop);
  std::signal(SIGUSR1, request_stop);
  for (int signo : {SIGINT, SIGHUP})
    if (!ignored_by_the_launcher(signo)) std::signal(signo, request_stop);
  std::signal(SIGXFSZ, SIG_IGN);
}

/// Test hook FSDP_TEST_RAISE=SIGNO:PLACE raises SIGNO on every rank at PLACE ("start": before the
/// first step, after the model is built; "finish": after the last step).
inline void raise_test_signal(const char* place) {
  const char* v = std::getenv("FSDP_TEST_RAISE");
  if (!v) return;
  int signo = 0;
  char where[16] = {};
  if (std::sscanf(v, "%d:%15s", &signo, where) == 2 && std::string(where) == place) std::raise(signo);
}

/// A stop signal that came after the last step's (the final evaluation, save or export): the run
/// ended as usual, exit 0, and says so, since rank 0 announced exit 3 at SIGTERM. Collective.
inline void say_a_stop_signal_came_late(MpiComm& world) {
  raise_test_signal("finish");
  std::int64_t signo = g_stop_signal;
  world.all_reduce(&signo, &signo, 1, fsdp::DType::kInt64, fsdp::ReduceOp::kMax);
  if (signo != 0 && world.rank() == 0)
    std::fprintf(stderr, "fsdp-train: %s came after the last step: the run finished as usual (final checkpoint, export, summary.json), exit 0\n",
                 stop_signal_name(signo).c_str());
}

/// Dumps the flight recorder when SIGTERM arrives: mpirun and srun send it to the surviving ranks when a
/// rank died (Open MPI's SIGKILL follows a second later), so this is the record of where they were. A
/// thread does it, since the handler may neither lock nor write; the graceful stop goes on as before.
class TerminateDumper {
 public:
  TerminateDumper() {
    if (sem_init(&g_terminate_posted, 0, 0) == 0) thread_ = std::thread([this] { watch(); });
  }
  ~TerminateDumper() {
    if (!thread_.joinable()) return;
    quitting_ = true;
    sem_post(&g_terminate_posted);
    thread_.join();
  }
  TerminateDumper(const TerminateDumper&) = delete;
  TerminateDumper& operator=(const TerminateDumper&) = delete;

 private:
  void watch() {
    auto& recorder = fsdp::FlightRecorder::instance();
    for (;;) {
      int rc;
      while ((rc = sem_wait(&g_terminate_posted)) != 0 && errno == EINTR) {}
      if (rc != 0) return;
      // A SIGTERM that came just before the run ended is still dumped.
      if (g_terminate_pending) {
        g_terminate_pending = 0;
        dump(recorder);
      }
      if (quitting_) return;
    }
  }
  static void dump(fsdp::FlightRecorder& recorder) {
    // Said first, before the recorder's file: mpirun's or Slurm's SIGKILL may follow within a second.
    if (recorder.rank() == 0)
      std::fprintf(stderr,
                   "fsdp-train: SIGTERM received: the step ends, a checkpoint is saved, exit 3 (unless the job is killed first; after the "
                   "last step the run finishes as usual)\n");
    const auto waiting = recorder.oldest_unfinished();
    const auto path = recorder.dump();
    if (path && waiting)  // a rank inside a collective at SIGTERM: the likely sign that a peer is gone
      std::fprintf(stderr,
                   "fsdp-train: rank %d: SIGTERM while in collective #%llu %s of %s (%lld bytes, step %lld) for %.1f s; last collectives in %s\n",
                   recorder.rank(), static_cast<unsigned long long>(waiting->first.seq), waiting->first.kind, waiting->second.c_str(),
                   static_cast<long long>(waiting->first.bytes), static_cast<long long>(waiting->first.step), recorder.now() - waiting->first.start_s,
                   path->c_str());
  }
  std::atomic<bool> quitting_{false};
  std::thread thread_;
};

/// A fatal signal: this rank's flight recorder goes to disk (best effort: not async-signal-safe, as
/// c10d's), then the signal does what it would have done.
extern "C" inline void dump_flight_and_die(int signo) {
  fsdp::FlightRecorder::instance().dump();
  std::signal(signo, SIG_DFL);
  std::raise(signo);
}

/// SIGBUS: a memory-mapped input (token data) truncated or failing under the run is named first
/// (mapped_files.hpp), then the flight recorder is dumped as for every fatal signal.
extern "C" inline void name_the_mapped_file_and_die(int signo, siginfo_t* info, void*) {
  mapped_files::describe_fault(info != nullptr ? info->si_addr : nullptr, fsdp::FlightRecorder::instance().rank());
  dump_flight_and_die(signo);
}

/// Fatal signals dump this rank's flight recorder and die; SIGBUS also names a mapped file it hit.
inline void dump_and_die_on_fatal_signals() {
  for (int sig : {SIGSEGV, SIGABRT, SIGFPE, SIGILL}) std::signal(sig, dump_flight_and_die);
  struct sigaction bus {};
  bus.sa_sigaction = name_the_mapped_file_and_die;
  bus.sa_flags = SA_SIGINFO;
  sigemptyset(&bus.sa_mask);
  ::sigaction(SIGBUS, &bus, nullptr);
}

/// Under mpirun (Open MPI starts the local ranks as its children, each in a process group of its own,
/// so a terminal's Ctrl-C reaches mpirun only): when mpirun is gone (a second Ctrl-C or a kill makes it
/// return at once) this rank ends too, instead of training and writing checkpoints on its own after
/// the job was reported over. The last committed checkpoint stays the one to resume from.
inline void end_with_the_launcher() {
  if (!std::getenv("OMPI_COMM_WORLD_SIZE")) return;
  const pid_t launcher = ::getppid();
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) ::_exit(kExitFailure);  // it went before the request was in place
}

}  // namespace fsdp::app
