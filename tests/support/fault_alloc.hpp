// Test helper: an operator new that throws std::bad_alloc at the N-th allocation after
// arming (fault injection). It replaces the global operator new / delete: include this
// header in exactly one translation unit of an executable.
#pragma once

#include <atomic>
#include <cstdlib>
#include <new>

#include "support/sanitized.hpp"

namespace kvtest::fi {
inline std::atomic<long> countdown{0};  // > 0: armed; the allocation that brings it to 0 throws
// Failures injected so far. A sweep whose operation disarms by itself (fault_injection_prompt's
// ops disarm before describing their result, which may allocate) tells an absorbed failure
// by this count moving: disarm_fired() cannot tell that disarm from a failure that fired.
inline std::atomic<long> injected{0};
inline std::atomic<long> live{0};       // allocations not freed yet (a leak check)
inline bool fail_now() noexcept {
    long c = countdown.load(std::memory_order_relaxed);
    if (c <= 0) return false;
    if (countdown.fetch_sub(1, std::memory_order_relaxed) == 1) {
        injected.fetch_add(1, std::memory_order_relaxed);
        return true;
    }
    return false;
}
inline void* alloc(std::size_t n) {
    if (fail_now()) throw std::bad_alloc();
    if (void* p = std::malloc(n == 0 ? 1 : n)) {
        live.fetch_add(1, std::memory_order_relaxed);
        return p;
    }
    throw std::bad_alloc();
}
inline void* alloc_aligned(std::size_t n, std::align_val_t a) {
    if (fail_now()) throw std::bad_alloc();
    const auto al = static_cast<std::size_t>(a);
    const std::size_t sz = (n == 0 ? al : (n + al - 1) / al * al);
    if (void* p = std::aligned_alloc(al, sz)) {
        live.fetch_add(1, std::memory_order_relaxed);
        return p;
    }
    throw std::bad_alloc();
}
inline void release(void* p) noexcept {
    if (p != nullptr) live.fetch_sub(1, std::memory_order_relaxed);
    std::free(p);
}
/// The n-th allocation from now throws (n >= 1).
inline void arm(long n) { countdown.store(n); }
inline void disarm() { countdown.store(0); }
/// Disarms; whether the armed failure happened. A call can complete although it did: the
/// failing allocation was a nothrow new whose caller fell back (std::stable_sort's and
/// std::inplace_merge's temporary buffers do). A sweep must go on past such a point: the
/// failure points after it are still untried (ending there once left 124 of the 201 of
/// fault_injection_ops' iswa_cache "place + commit" untried, commit's among them).
inline bool disarm_fired() { return countdown.exchange(0) <= 0; }
/// Whether the armed failure has not happened yet.
inline bool armed() { return countdown.load() > 0; }

/// The failure point a sweep tries after n (`for (long n = 1;; n = fi::next_n(n))`; a sweep
/// ends at the first n the call completes before reaching: fi::disarm_fired). Every n in a
/// normal build. Under the sanitizers every n up to 64, then every third: there each n
/// rebuilds and compares the whole fixture at about a tenth of the speed, and the normal
/// build of the same tests (CI runs both) tries every n. Both fault injection executables
/// use it.
inline long next_n(long n) { return kvtest::sanitized && n >= 64 ? n + 3 : n + 1; }
}  // namespace kvtest::fi

void* operator new(std::size_t n) { return kvtest::fi::alloc(n); }
void* operator new[](std::size_t n) { return kvtest::fi::alloc(n); }
void* operator new(std::size_t n, std::align_val_t a) { return kvtest::fi::alloc_aligned(n, a); }
void* operator new[](std::size_t n, std::align_val_t a) { return kvtest::fi::alloc_aligned(n, a); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
    try {
        return kvtest::fi::alloc(n);
    } catch (...) {
        return nullptr;
    }
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
    try {
        return kvtest::fi::alloc(n);
    } catch (...) {
        return nullptr;
    }
}
void operator delete(void* p) noexcept { kvtest::fi::release(p); }
void operator delete[](void* p) noexcept { kvtest::fi::release(p); }
void operator delete(void* p, std::size_t) noexcept { kvtest::fi::release(p); }
void operator delete[](void* p, std::size_t) noexcept { kvtest::fi::release(p); }
void operator delete(void* p, std::align_val_t) noexcept { kvtest::fi::release(p); }
void operator delete[](void* p, std::align_val_t) noexcept { kvtest::fi::release(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { kvtest::fi::release(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { kvtest::fi::release(p); }
