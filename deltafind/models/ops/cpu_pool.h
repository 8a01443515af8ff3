// A persistent thread pool shared by deltafind's CPU kernels (mxfp4_cpu.cpp, stored_cpu.cpp).
// Each kernel library compiles its own copy; workers are detached and never torn down.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace df {

// A small persistent pool: run(n, fn) calls fn(i) for i in [0, n) on up to `threads` threads.
class Pool {
 public:
  void run(int n, int threads, const std::function<void(int)>& fn) {
    if (threads <= 1 || n <= 1) {
      for (int i = 0; i < n; ++i) fn(i);
      return;
    }
    std::lock_guard<std::mutex> call_lock(call_mu_);
    ensure(threads - 1);
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      next_.store(0);
      total_ = n;
      active_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    cv_.notify_all();
    work();
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return active_ == 0; });
    fn_ = nullptr;
  }

 private:
  void ensure(int count) {
    while (static_cast<int>(workers_.size()) < count) {
      workers_.emplace_back([this, seen = generation_]() mutable {
        for (;;) {
          {
            std::unique_lock<std::mutex> lk(mu_);
            cv_.wait(lk, [&] { return generation_ != seen; });
            seen = generation_;
          }
          work();
          std::lock_guard<std::mutex> lk(mu_);
          if (--active_ == 0) done_cv_.notify_all();
        }
      });
      workers_.back().detach();
    }
  }
  void work() {
    for (int i; (i = next_.fetch_add(1)) < total_;) (*fn_)(i);
  }
  std::mutex call_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* fn_ = nullptr;
  std::atomic<int> next_{0};
  int total_ = 0, active_ = 0;
  uint64_t generation_ = 0;
};

inline Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: detached workers may outlive static teardown
  return *p;
}

}  // namespace df
