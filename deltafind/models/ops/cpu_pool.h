// A persistent thread pool shared by deltafind's CPU kernels (mxfp4_cpu.cpp, stored_cpu.cpp).
// Each kernel library compiles its own copy; workers are detached and never torn down.
//
// A decode step makes ~120 short kernel calls per token (tens of microseconds each), so how a call
// starts and ends decides whether a second thread helps at all. With a condition variable alone,
// a worker woke ~30-50 us after the call began (a futex round trip on a VM), the caller did most of
// the work itself and then slept until the late worker checked in: 2 threads decoded SLOWER than 1
// (tests/bench/RESULTS.md). So:
// - a call publishes its tasks with one atomic store; idle workers spin on it for a bounded time
//   (`DELTAFIND_POOL_SPIN_US`, default 200 us: longer than the Python between two kernel calls of
//   a layer) and only then sleep on the condition variable;
// - the caller waits for the tasks to be DONE, not for every worker to check in: a worker that
//   wakes after the caller took every task costs the call nothing.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DF_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define DF_PAUSE() asm volatile("yield" ::: "memory")
#else
#define DF_PAUSE() std::this_thread::yield()
#endif

namespace df {

// run(n, threads, fn) calls fn(i) for i in [0, n) on up to `threads` threads (the caller is one).
class Pool {
 public:
  void run(int n, int threads, const std::function<void(int)>& fn) {
    if (threads <= 1 || n <= 1) {
      for (int i = 0; i < n; ++i) fn(i);
      return;
    }
    std::lock_guard<std::mutex> call_lock(call_mu_);
    ensure(threads - 1);
    fn_.store(&fn, std::memory_order_relaxed);
    total_.store(n, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (state_.load(std::memory_order_relaxed) >> 32) + 1;
    state_.store(gen << 32);  // generation in the high half, next task index in the low half
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      cv_.notify_all();
    }
    work(gen);
    // The rest of the tasks are claimed and running on workers: they end soon.
    for (int spins = 0; done_.load(std::memory_order_acquire) < n; ++spins)
      if (spins < 4096) DF_PAUSE(); else std::this_thread::yield();
  }

 private:
  void ensure(int count) {
    while (static_cast<int>(workers_.size()) < count) {
      workers_.emplace_back([this] {
        uint64_t seen = state_.load() >> 32;
        for (;;) {
          seen = wait_past(seen);
          work(seen);
        }
      });
      workers_.back().detach();
    }
  }

  // The next generation after `seen`: spin for spin_us_, then sleep until a call wakes us.
  uint64_t wait_past(uint64_t seen) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
    for (int i = 1;; ++i) {
      const uint64_t gen = state_.load(std::memory_order_acquire) >> 32;
      if (gen != seen) return gen;
      DF_PAUSE();
      if (i % 64 == 0 && std::chrono::steady_clock::now() >= until) break;
    }
    std::unique_lock<std::mutex> lk(mu_);
    sleepers_.fetch_add(1);
    cv_.wait(lk, [&] { return (state_.load() >> 32) != seen; });
    sleepers_.fetch_sub(1);
    return state_.load(std::memory_order_acquire) >> 32;
  }

  // Claim and run tasks of generation `gen` until none are left (or a newer call has begun).
  void work(uint64_t gen) {
    for (uint64_t s = state_.load(std::memory_order_acquire);;) {
      if ((s >> 32) != gen || static_cast<int>(s & 0xFFFFFFFFu) >= total_.load(std::memory_order_relaxed)) return;
      if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;  // s reloaded
      // Claimed while unfinished, so this generation's fn_ stays valid until done_ counts it.
      (*fn_.load(std::memory_order_relaxed))(static_cast<int>(s & 0xFFFFFFFFu));
      done_.fetch_add(1, std::memory_order_release);
      s = state_.load(std::memory_order_acquire);
    }
  }

  static long spin_from_env() {
    const char* v = std::getenv("DELTAFIND_POOL_SPIN_US");
    return v ? std::strtol(v, nullptr, 10) : 200;
  }

  std::mutex call_mu_, mu_;
  std::condition_variable cv_;
  std::vector<std::thread> workers_;
  std::atomic<uint64_t> state_{0};
  std::atomic<const std::function<void(int)>*> fn_{nullptr};
  std::atomic<int> total_{0}, done_{0}, sleepers_{0};
  const long spin_us_ = spin_from_env();
};

inline Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: detached workers may outlive static teardown
  return *p;
}

}  // namespace df
