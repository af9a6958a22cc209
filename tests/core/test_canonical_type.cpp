// kv_cache<Policies...> names one canonical type whatever the order of the policies and
// whether defaults are spelled out (issue: one canonical type).
#include <type_traits>

#include <doctest/doctest.h>

#include <kvcache/element/bf16.hpp>
#include <kvcache/element/f16.hpp>
#include <kvcache/layout/paged.hpp>
#include <kvcache/layout/ring.hpp>
#include <kvcache/memory/kv_cache.hpp>
#include <kvcache/reuse/chunk_shift.hpp>
#include <kvcache/reuse/lcp.hpp>

namespace kv = kvcache;

// Order does not matter.
static_assert(std::is_same_v<kv::kv_cache<kv::f16, kv::contiguous<>>, kv::kv_cache<kv::contiguous<>, kv::f16>>);
static_assert(std::is_same_v<kv::kv_cache<kv::bf16, kv::paged<32>, kv::reuse::lcp>,
                             kv::kv_cache<kv::reuse::lcp, kv::paged<32>, kv::bf16>>);
static_assert(std::is_same_v<kv::kv_cache<kv::bf16, kv::paged<32>, kv::reuse::lcp>,
                             kv::kv_cache<kv::paged<32>, kv::reuse::lcp, kv::bf16>>);
// Explicit defaults are the defaults.
static_assert(std::is_same_v<kv::kv_cache<>, kv::kv_cache<kv::f32>>);
static_assert(std::is_same_v<kv::kv_cache<>, kv::kv_cache<kv::contiguous<>, kv::reuse::none, kv::f32>>);
static_assert(std::is_same_v<kv::kv_cache<kv::f16>, kv::kv_cache<kv::f16, kv::contiguous<>, kv::reuse::none>>);
static_assert(std::is_same_v<kv::kv_cache<kv::ring<64>>, kv::kv_cache<kv::f32, kv::ring<64>>>);
// The canonical spelling.
static_assert(std::is_same_v<kv::kv_cache<kv::reuse::chunk_shift<16>, kv::f16>,
                             kv::basic_kv_cache<kv::f16, kv::contiguous<>, kv::reuse::chunk_shift<16>>>);
// Different policies stay different types.
static_assert(!std::is_same_v<kv::kv_cache<kv::f16>, kv::kv_cache<kv::bf16>>);
static_assert(!std::is_same_v<kv::kv_cache<kv::paged<32>>, kv::kv_cache<kv::paged<64>>>);
// Every kv_cache is a memory, and a kv_memory.
static_assert(kv::kv_memory<kv::kv_cache<kv::f16, kv::ring<64>>>);
static_assert(kv::kv_memory<kv::kv_cache<kv::paged<32>, kv::bf16>>);

TEST_CASE("kv_cache: one canonical type for every spelling of the same policies") {
    // A function written for one spelling accepts a cache built with another.
    auto capacity_of = [](const kv::kv_cache<kv::contiguous<>, kv::f16>& c) { return c.capacity(); };
    kv::model_shape s;
    s.n_layer = 1;
    s.n_head_kv = 1;
    s.head_dim_k = 16;
    s.n_cells = 64;
    s.n_seq_max = 2;
    kv::kv_cache<kv::f16, kv::contiguous<>, kv::reuse::none> c(s);
    CHECK(capacity_of(c) == 64);
    CHECK(std::is_same_v<decltype(c)::element, kv::f16>);
    CHECK(std::is_same_v<decltype(c)::layout, kv::contiguous<>>);
    CHECK(std::is_same_v<decltype(c)::reuse, kv::reuse::none>);
}
