// K/V buffers of 2 MiB or more start on a 2 MiB boundary and, on Linux with
// transparent huge pages compiled in, carry the MADV_HUGEPAGE advice (the "hg" flag of
// their mapping in /proc/self/smaps).
// Every layout that owns K/V storage (contiguous, paged, ring) allocates through it.
#include <doctest/doctest.h>

#include <kvcache/element/f16.hpp>
#include <kvcache/memory/kv_cache.hpp>
#include <kvcache/layout/paged.hpp>
#include <kvcache/layout/ring.hpp>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "layout_test_util.hpp"

namespace {

using namespace kvcache;

// 8 heads x 128 x 2 bytes x 2 layers = 4 KiB per cell and buffer.
model_shape big_shape(std::uint32_t n_cells) { return kvtest::layout_shape(n_cells, 2, 2, 8, 128); }

// The VmFlags of the mapping of /proc/self/smaps that contains address a ("" if none).
std::string vm_flags_of(std::uintptr_t a) {
    std::ifstream in("/proc/self/smaps");
    std::string line;
    bool inside = false;
    while (std::getline(in, line)) {
        unsigned long lo = 0, hi = 0;
        if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2) {  // a mapping's first line
            inside = a >= lo && a < hi;
            continue;
        }
        if (inside && line.rfind("VmFlags:", 0) == 0) return line;
    }
    return "";
}

bool thp_compiled_in() {
    std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
    return f.good();
}

template <class Cache>
void check_big(const Cache& cache) {
    for (const void* p : {static_cast<const void*>(cache.storage().view(0).k),
                          static_cast<const void*>(cache.storage().view(0).v)}) {
        const auto a = reinterpret_cast<std::uintptr_t>(p);
        CHECK(a % huge_page_bytes == 0);
#if defined(__linux__) && !defined(KVCACHE_NO_HUGE_PAGES)
        if (thp_compiled_in()) {
            const std::string flags = vm_flags_of(a);
            INFO("VmFlags: " << flags);
            CHECK(flags.find(" hg") != std::string::npos);
        }
#endif
    }
}

}  // namespace

TEST_CASE("huge pages: big K/V buffers are 2 MiB aligned and advised") {
    SUBCASE("contiguous") {
        const kv_cache<f16> cache(big_shape(4096));  // 16 MiB per buffer
        check_big(cache);
    }
    SUBCASE("paged") {
        const kv_cache<f16, paged<32>> cache(big_shape(4096));
        check_big(cache);
    }
    SUBCASE("ring") {
        const kv_cache<f16, ring<1024>> cache(big_shape(ring<1024>::cells_for(2, 512)));
        check_big(cache);
    }
    SUBCASE("the buffers are zeroed and usable after the advice") {
        kv_cache<f16> cache(big_shape(1024));
        const auto v = cache.storage().view(1);
        const std::size_t n = std::size_t{cache.storage().n_cells_padded()} * 8 * 128;
        bool zero = true;
        for (std::size_t i = 0; i < n; i += 997) zero = zero && v.k[i] == half{} && v.v[i] == half{};
        CHECK(zero);
    }
}
