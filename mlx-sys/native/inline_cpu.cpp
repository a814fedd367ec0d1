// Inline CPU scheduling for MLX 0.32.2: an opt-in switch that runs the CPU stream's tasks on the thread that
// enqueues them instead of handing each one to the stream's worker thread.
//
// What MLX 0.32.2 does (the sources this relies on, from the ml-explore/mlx tree at the 0.32.2 bump, 29006584f):
// - `mlx/backend/cpu/encoder.h`: `CommandEncoder::dispatch` wraps every CPU kernel in a task and calls
//   `scheduler::enqueue(stream, task)`; every 10th dispatch also counts an active task and enqueues a completion
//   task after it. `mlx/backend/cpu/eval.cpp` dispatches one more empty task per primitive that keeps its inputs
//   alive until the kernel ran.
// - `mlx/scheduler.cpp`: `Scheduler::enqueue` pushes the task on the stream's `StreamThread` queue under a mutex
//   and wakes the worker with a condition variable; the worker runs tasks one at a time, in queue order, and keeps
//   the first exception to rethrow it at the next enqueue from the main thread (`StreamThread::enqueue`,
//   `error.check()`) or at `check_error`. `signal_event` / `wait_event` are the same queue with an event.
// - `mlx/transforms.cpp` (`eval_impl`): evaluates the tape in order on the calling thread, so every task a
//   primitive enqueues has all its inputs' tasks enqueued before it.
// - The wheel's `libmlx.so` calls `Scheduler::enqueue`, `signal_event`, `wait_event` and `check_error` through its
//   dynamic symbol table (601 `enqueue@plt` call sites in the x86-64 `mlx-cpu==0.32.2` wheel), so definitions in
//   the executable take their place.
//
// Why the bytes cannot change: the worker runs the tasks one at a time in the order they were enqueued; inline,
// the same tasks run in the same order, one at a time, on another thread, with the same kernels. Only the
// hand-off goes (a lock, a wake-up and usually a context switch per task).
//
// When the switch is off (the default), each entry forwards to MLX's own definition (found with
// `dlsym(RTLD_NEXT, ...)`), so behaviour is MLX's. The switch turns on only when all four symbols resolve to the
// definitions here and MLX's own, and only for CPU streams; anything else is refused with a reason.

#include <dlfcn.h>

#include <cstring>
#include <exception>
#include <functional>
#include <string>

#include "mlx/event.h"
#include "mlx/scheduler.h"
#include "mlx/version.h"

namespace {

using mlx::core::Event;
using mlx::core::Stream;
using mlx::core::scheduler::Scheduler;

const char* const ENQUEUE = "_ZN3mlx4core9scheduler9Scheduler7enqueueENS0_6StreamESt8functionIFvvEE";
const char* const WAIT_EVENT =
    "_ZN3mlx4core9scheduler9Scheduler10wait_eventENS0_6StreamENS0_5EventESt8functionIFvRS4_EE";
const char* const SIGNAL_EVENT =
    "_ZN3mlx4core9scheduler9Scheduler12signal_eventENS0_6StreamENS0_5EventESt8functionIFvRS4_EE";
const char* const CHECK_ERROR = "_ZN3mlx4core9scheduler9Scheduler11check_errorENS0_6StreamE";

using EnqueueFn = void (*)(Scheduler*, Stream, std::function<void()>);
using EventFn = void (*)(Scheduler*, Stream, Event, std::function<void(Event&)>);
using CheckFn = void (*)(Scheduler*, Stream);

template <class F>
F next(const char* name) {
  return reinterpret_cast<F>(dlsym(RTLD_NEXT, name));
}

EnqueueFn real_enqueue() {
  static EnqueueFn f = next<EnqueueFn>(ENQUEUE);
  return f;
}
EventFn real_wait_event() {
  static EventFn f = next<EventFn>(WAIT_EVENT);
  return f;
}
EventFn real_signal_event() {
  static EventFn f = next<EventFn>(SIGNAL_EVENT);
  return f;
}
CheckFn real_check_error() {
  static CheckFn f = next<CheckFn>(CHECK_ERROR);
  return f;
}

// Per thread: MLX 0.32.2 gives each thread its own default CPU stream (`mlx/stream.cpp`, `default_stream_storage`)
// and its own command encoders (`mlx/backend/cpu/encoder.cpp`), so a thread that turns the switch on runs its own
// stream's tasks inline and every other thread keeps MLX's worker.
thread_local bool inline_on = false;
// The first exception an inline task threw, rethrown at the next enqueue or check (as MLX's worker keeps it).
thread_local std::exception_ptr pending_error;
std::string refusal;

bool inline_for(const Stream& s) {
  return inline_on && s.device == mlx::core::Device::cpu;
}

void rethrow_pending() {
  if (pending_error) {
    auto e = pending_error;
    pending_error = nullptr;
    std::rethrow_exception(e);
  }
}

void missing(const char* what) {
  if (refusal.empty()) {
    refusal = what;
  }
}

}  // namespace

namespace mlx::core::scheduler {

void Scheduler::enqueue(Stream s, std::function<void()> task) {
  if (inline_for(s)) {
    rethrow_pending();
    try {
      task();
    } catch (...) {
      if (!pending_error) {
        pending_error = std::current_exception();
      }
    }
    return;
  }
  auto f = real_enqueue();
  if (!f) {
    std::terminate();
  }
  f(this, s, std::move(task));
}

void Scheduler::wait_event(Stream s, Event event, std::function<void(Event&)> task) {
  if (inline_for(s)) {
    task(event);
    return;
  }
  auto f = real_wait_event();
  if (!f) {
    std::terminate();
  }
  f(this, s, std::move(event), std::move(task));
}

void Scheduler::signal_event(Stream s, Event event, std::function<void(Event&)> task) {
  if (inline_for(s)) {
    task(event);
    return;
  }
  auto f = real_signal_event();
  if (!f) {
    std::terminate();
  }
  f(this, s, std::move(event), std::move(task));
}

void Scheduler::check_error(Stream s) {
  if (inline_for(s)) {
    rethrow_pending();
  }
  auto f = real_check_error();
  if (!f) {
    std::terminate();
  }
  f(this, s);
}

}  // namespace mlx::core::scheduler

extern "C" {

// Turns inline CPU scheduling on (`on != 0`) or off for the calling thread. Returns 1 when the requested state holds, 0 when turning it
// on was refused (the reason is `kvsim_mlx_inline_cpu_refusal()`). Call it between evaluations, with no CPU work
// in flight (after an `eval` returned): the tasks already queued on the worker finish there first.
int kvsim_mlx_inline_cpu(int on) {
  if (!on) {
    inline_on = false;
    return 1;
  }
  refusal.clear();
  if (std::strcmp(mlx::core::version(), "0.32.2") != 0) {
    refusal = std::string("MLX is ") + mlx::core::version() + ", the switch is written against 0.32.2's scheduler";
    return 0;
  }
  for (const char* name : {ENQUEUE, WAIT_EVENT, SIGNAL_EVENT, CHECK_ERROR}) {
    void* theirs = dlsym(RTLD_NEXT, name);
    if (!theirs) {
      missing("libmlx.so does not export an MLX 0.32.2 scheduler entry point");
      return 0;
    }
    // The process resolves the name to the first definition in load order: the executable's when it exports this
    // file's, else libmlx.so's own (then the switch would change nothing).
    if (dlsym(RTLD_DEFAULT, name) == theirs) {
      missing("this executable does not take the place of libmlx.so's scheduler (its symbol is not exported)");
      return 0;
    }
  }
  // Drain what the worker still holds, so nothing queued there runs after an inline task.
  mlx::core::synchronize(mlx::core::default_stream(mlx::core::Device::cpu));
  inline_on = true;
  return 1;
}

// 1 while inline CPU scheduling is on for the calling thread.
int kvsim_mlx_inline_cpu_active() {
  return inline_on ? 1 : 0;
}

// Why the last request to turn the switch on was refused ("" when it was not).
const char* kvsim_mlx_inline_cpu_refusal() {
  return refusal.c_str();
}
}
