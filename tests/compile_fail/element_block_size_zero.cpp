// expect: kvcache: the element policy does not satisfy kvcache::element_policy: optional member 7
// block_size 0 is meaningless (a block holds at least one value): refused, naming the member.
#include <kvcache/kvcache.hpp>

#include <cstdint>

struct zero_block_element {
    using policy_kind = kvcache::element_tag;
    using storage_type = float;
    static constexpr std::string_view name = "zero_block";
    static constexpr std::uint32_t type_id = 96;
    static constexpr std::uint32_t block_size = 0;
    static void to_float(const float* src, float* dst, std::size_t n) noexcept {
        for (std::size_t i = 0; i < n; ++i) dst[i] = src[i];
    }
    static void from_float(const float* src, float* dst, std::size_t n) noexcept {
        for (std::size_t i = 0; i < n; ++i) dst[i] = src[i];
    }
};

int main() {
    kvcache::model_shape s;
    kvcache::kv_cache<zero_block_element> cache(s);
    return 0;
}
