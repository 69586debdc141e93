// fsdp-train (app layer): the process's signals. SIGTERM / SIGUSR1 ask for a graceful
// stop; SIGTERM also dumps the flight recorder (a peer died, or the job ends); fatal signals dump it
// and die.
#pragma once

#include <fsdp/fsdp.hpp>
#include <semaphore.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstdio>
#include <string>
#include <thread>

#include "choices.hpp"
#include "train/ranks.hpp"

namespace fsdp::app {

/// The signal that asked for a graceful stop (SIGTERM, SIGUSR1), 0 if none.
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

/// SIGTERM (Slurm's time limit, scancel), SIGUSR1 (sbatch --signal) and SIGINT (Ctrl-C) finish the
/// step, save and exit 3. Past a file size limit (ulimit -f) a write fails with EFBIG and the save
/// reports it, instead of SIGXFSZ killing the rank in the middle of a checkpoint.
inline void stop_after_the_step_on_signals() {
  std::signal(SIGTERM, request_stop);
  std::signal(SIGUSR1, request_stop);
  std::signal(SIGINT, request_stop);
  std::signal(SIGXFSZ, SIG_IGN);
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
      std::fprintf(stderr, "fsdp-train: SIGTERM received: the step ends, a checkpoint is saved, exit 3 (unless the job is killed first)\n");
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
