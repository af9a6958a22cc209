// The element contract's compile-time parts (concepts.hpp, "Element policy";
// element/contract.hpp): the optional block_size, tiled_element, has_simd_storage.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <cstdint>

namespace {

template <std::uint32_t Block, class Storage = std::int8_t>
struct blocky {
    using policy_kind = kvcache::element_tag;
    using storage_type = Storage;
    static constexpr std::string_view name = "blocky";
    static constexpr std::uint32_t type_id = 0x2000 + Block;
    static constexpr std::uint32_t block_size = Block;
    static void to_float(const Storage*, float*, std::size_t) noexcept {}
    static void from_float(const float*, Storage*, std::size_t) noexcept {}
};

struct plain {
    using policy_kind = kvcache::element_tag;
    using storage_type = std::int16_t;
    static constexpr std::string_view name = "plain";
    static constexpr std::uint32_t type_id = 0x3000;
    static void to_float(const std::int16_t*, float*, std::size_t) noexcept {}
    static void from_float(const float*, std::int16_t*, std::size_t) noexcept {}
};

struct throwing_from_float : plain {
    static void from_float(const float*, std::int16_t*, std::size_t) {}
};

}  // namespace

// block_size is optional (default 1) and, when present, must be >= 1.
static_assert(kvcache::element_block_size_v<plain> == 1);
static_assert(kvcache::element_block_size_v<kvcache::f16> == 1);
static_assert(kvcache::element_block_size_v<blocky<32>> == 32);
static_assert(kvcache::element_policy<blocky<32>> && kvcache::element_policy<blocky<1>>);
static_assert(!kvcache::element_policy<blocky<0>>);
// The tiled layouts store one value per storage_type, or blocks of 32 values of one cell.
static_assert(kvcache::tiled_element<plain> && kvcache::tiled_element<blocky<1>>);
static_assert(kvcache::tiled_element<blocky<32>> && !kvcache::tiled_element<blocky<16>>);
// to_float / from_float must be noexcept.
static_assert(!kvcache::element_policy<throwing_from_float>);
// Only the built-in elements are read with SIMD loads; every other goes through to_float.
static_assert(kvcache::detail::has_simd_storage<kvcache::f32> && kvcache::detail::has_simd_storage<kvcache::f16> &&
              kvcache::detail::has_simd_storage<kvcache::bf16>);
static_assert(!kvcache::detail::has_simd_storage<plain>);

TEST_CASE("element contract: a custom element builds a cache of every tiled layout") {
    kvcache::model_shape s;
    s.n_layer = 1;
    s.n_head_kv = 1;
    s.head_dim_k = 8;
    s.n_cells = 64;
    CHECK(kvcache::kv_cache<plain>(s).bytes_per_token() > 0);
    CHECK(kvcache::kv_cache<blocky<1>, kvcache::contiguous<kvcache::v_layout::transposed>>(s).bytes_per_token() > 0);
}
