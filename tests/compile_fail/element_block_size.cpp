// expect: kvcache: the tiled layouts \(contiguous, paged, ring\) store elements of block_size 1 or 32
// A block element of 16 values satisfies element_policy, but the tiled layouts store
// blocks of 32 values only (or single values): kv_cache refuses it with a message that
// says so.
#include <kvcache/kvcache.hpp>

#include <cstdint>

struct q8_block_element {
    using policy_kind = kvcache::element_tag;
    using storage_type = std::int8_t;
    static constexpr std::string_view name = "q8_block";
    static constexpr std::uint32_t type_id = 97;
    static constexpr std::uint32_t block_size = 16;
    static void to_float(const std::int8_t* src, float* dst, std::size_t n) noexcept {
        for (std::size_t i = 0; i < n; ++i) dst[i] = src[i];
    }
    static void from_float(const float* src, std::int8_t* dst, std::size_t n) noexcept {
        for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<std::int8_t>(src[i]);
    }
};
static_assert(kvcache::element_policy<q8_block_element>);  // the contract admits block elements
static_assert(kvcache::element_block_size_v<q8_block_element> == 16);
static_assert(!kvcache::tiled_element<q8_block_element>);

int main() {
    kvcache::model_shape s;
    kvcache::kv_cache<q8_block_element> cache(s);
    return 0;
}
