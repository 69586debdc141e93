// A crash report for tests that run where no debugger is (a GPU node reached for minutes): on SIGSEGV,
// SIGBUS or SIGABRT, stderr gets the thread, the faulting address, the stack as glibc can walk it and,
// for a call through a null function pointer (pc 0, where the walk stops at once), the caller found
// from the return address the call left on top of the stack. Install it after MPI_Init, whose own
// handler would replace it. x86-64 Linux; elsewhere a no-op.
#pragma once

#include <csignal>

#if defined(__x86_64__) && defined(__linux__)
#include <dlfcn.h>
#include <execinfo.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <initializer_list>
#endif

namespace test_support {

#if defined(__x86_64__) && defined(__linux__)
namespace detail {

inline void print_symbol(const char* what, void* address) {
  Dl_info info{};
  char line[512];
  if (address != nullptr && dladdr(address, &info) != 0 && info.dli_fname != nullptr) {
    const auto base = reinterpret_cast<char*>(info.dli_saddr != nullptr ? info.dli_saddr : info.dli_fbase);
    std::snprintf(line, sizeof line, "crash report: %s %p = %s(%s+0x%tx)\n", what, address, info.dli_fname,
                  info.dli_sname != nullptr ? info.dli_sname : "", static_cast<char*>(address) - base);
  } else {
    std::snprintf(line, sizeof line, "crash report: %s %p (no symbol)\n", what, address);
  }
  (void)!write(STDERR_FILENO, line, std::strlen(line));
}

inline void on_crash(int signal_number, siginfo_t* info, void* context) {
  const auto* uc = static_cast<const ucontext_t*>(context);
  void* pc = reinterpret_cast<void*>(uc->uc_mcontext.gregs[REG_RIP]);
  void* sp = reinterpret_cast<void*>(uc->uc_mcontext.gregs[REG_RSP]);
  char line[256];
  std::snprintf(line, sizeof line, "crash report: signal %d in thread %ld (process %d), fault address %p, pc %p\n", signal_number,
                static_cast<long>(syscall(SYS_gettid)), static_cast<int>(getpid()), info->si_addr, pc);
  (void)!write(STDERR_FILENO, line, std::strlen(line));
  print_symbol("pc", pc);
  if (pc == nullptr && sp != nullptr) print_symbol("called from", *static_cast<void**>(sp));
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  std::signal(signal_number, SIG_DFL);
  std::raise(signal_number);
}

}  // namespace detail

inline void install_crash_report() {
  void* warm[1];
  backtrace(warm, 1);  // loads libgcc's unwinder now: the handler must not be the first to (malloc)
  struct sigaction action {};
  action.sa_sigaction = detail::on_crash;
  action.sa_flags = SA_SIGINFO;
  sigemptyset(&action.sa_mask);
  for (int s : {SIGSEGV, SIGBUS, SIGABRT}) sigaction(s, &action, nullptr);
}
#else
inline void install_crash_report() {}
#endif

}  // namespace test_support
