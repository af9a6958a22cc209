// expect: kvcache: the element policy does not satisfy kvcache::element_policy: member 5 is missing or not
// A user-written element policy whose to_float is not noexcept must be rejected with a
// message that names the member (the kernels call it from noexcept code).
#include <kvcache/kvcache.hpp>

#include <cstdint>

struct not_noexcept_element {
    using policy_kind = kvcache::element_tag;
    using storage_type = std::int16_t;
    static constexpr std::string_view name = "not_noexcept";
    static constexpr std::uint32_t type_id = 98;
    static void to_float(const std::int16_t* src, float* dst, std::size_t n) {  // (no noexcept)
        for (std::size_t i = 0; i < n; ++i) dst[i] = src[i];
    }
    static void from_float(const float* src, std::int16_t* dst, std::size_t n) noexcept {
        for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<std::int16_t>(src[i]);
    }
};

int main() {
    kvcache::model_shape s;
    kvcache::kv_cache<not_noexcept_element> cache(s);
    return 0;
}
